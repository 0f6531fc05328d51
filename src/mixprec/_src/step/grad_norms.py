"""The squared norms of gradients the step in backward counts as they come (``step_in_backward``): one gradient's
(:func:`square_norm`) and several in one call (:func:`square_norms`), each the same value bit for bit.

A low-precision CPU gradient is read where it lies (``optim.cpu_adam``'s kernel); fp32 ones by torch's norm. Nothing
here syncs with a device.
"""

from __future__ import annotations

import torch

from mixprec._src.optim import cpu_adam

__all__ = ["NORM_CHUNK", "square_norm", "square_norms"]

#: values whose norm is taken at once: a low-precision gradient's fp32 copy stays this small
NORM_CHUNK = 1 << 20


def square_norm(g: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of ``g`` (a 0-dim tensor). A low-precision gradient on the CPU is read where it
    lies (``cpu_adam.square_norm``); elsewhere a chunk at a time: ``vector_norm`` with ``dtype=float32`` copies
    its whole input to fp32 first on devices whose norm kernel does not cast as it reads (CUDA's does), the size
    of the largest gradient again."""
    low = g.dtype != torch.float32  # the kernel reads any contiguous shape in order: no view made to flatten it
    native = cpu_adam.square_norm(g if g.is_contiguous() else g.reshape(-1)) if low else None
    if native is not None:
        return native
    flat = g.reshape(-1)
    if flat.dtype == torch.float32 or flat.numel() <= NORM_CHUNK:
        whole: torch.Tensor = torch.linalg.vector_norm(flat, dtype=torch.float32).square()
        return whole
    parts = [
        torch.linalg.vector_norm(flat[i : i + NORM_CHUNK], dtype=torch.float32).square()
        for i in range(0, flat.numel(), NORM_CHUNK)
    ]
    return torch.stack(parts).sum()


def square_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each of ``grads``' :func:`square_norm`, as a 1-D fp32 tensor in their order, in ops that do not grow with
    their number: the gradients of one dtype together (low-precision CPU ones in one call, ``cpu_adam.square_norms``;
    fp32 CPU ones by one multi-tensor norm, on the CPU ``vector_norm`` of each: the same values), the groups' norms
    put in order by one indexed read."""
    kinds: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        kinds.setdefault(g.dtype, []).append(i)
    if len(kinds) == 1:
        return _square_norms_alike(grads)
    parts, order = [], []
    for places in kinds.values():
        parts.append(_square_norms_alike([grads[i] for i in places]))
        order += places
    inverse = [0] * len(order)  # where each gradient's norm lies in the dtypes' norms, one after the other
    for at, i in enumerate(order):
        inverse[i] = at
    return torch.cat(parts)[cpu_adam.rows_table([inverse])[0].to(parts[0].device)]


def _square_norms_alike(grads: list[torch.Tensor]) -> torch.Tensor:
    """:func:`square_norms` of gradients of one dtype."""
    if grads[0].dtype != torch.float32:
        native = cpu_adam.square_norms(grads)
        if native is not None:
            return native
    else:
        for g in grads:  # a loop, not all() over a generator: this runs at every step
            if not g.is_cpu:
                break
        else:
            return torch.stack(torch._foreach_norm(grads)).square()
    return torch.stack([square_norm(g) for g in grads])
