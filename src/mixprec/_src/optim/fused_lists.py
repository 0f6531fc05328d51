"""torch's fused Adam(W) step (``fused=True``) on fp32 CPU weights, a whole list in one call, bit for bit, with O2's
bf16 copies written in the same pass: :func:`step_list`.

torch's fused CPU Adam(W) runs one kernel a tensor (each its own parallel region), after a multi-tensor add to
the step counts; O2 then copies every master into its bf16 compute copy, one copy a tensor. This kernel
(``optim/kernels/adam_fused_lists.cpp``, built as ``cpu_lists``' are) computes each value as torch's fused kernel
does (its roundings and fused multiply-adds, found by measurement; the correctly rounded root; the tail of each
tensor as that kernel's compiler wrote it) on the chunks of a table of the tensors' addresses, in one parallel
region a param group and step count, and writes a weight's bf16 copy (to nearest even, as ``copy_``) where the
row names one. Whether it matches torch on this machine is checked once per process (:func:`available`: a probe of
a few steps against torch's fused step, copies included); where it does not, or does not build, torch's fused
step runs. A copy of a NaN weight is a NaN whose payload may differ from ``copy_``'s. Nothing here syncs: CPU
tensors only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from mixprec._src.optim import aten_lists, cpu_adam, cpu_lists

__all__ = ["available", "expected", "scalars", "step_list", "step_table", "supports", "table"]

_SOURCE = cpu_lists._PRELUDE + cpu_adam.kernel_source("adam_fused_lists.cpp")
#: the storage dtypes the kernel steps, and their C++ types
_STORAGE = {torch.float32: "float", torch.bfloat16: "BF16"}


@functools.cache
def _compiled(dtype: torch.dtype = torch.float32) -> Any:
    argtypes = ["const int64_t*", "int64_t", "const float*", "int64_t"]
    return cpu_lists._load(argtypes, _SOURCE % {"helpers": cpu_adam._HELPERS, "storage": _STORAGE[dtype]})


def expected(dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch's fused Adam(W) of ``dtype`` CPU weights is expected to take :func:`step_list` (it has not
    failed to build or match in this process); compiles nothing."""
    return dtype in _STORAGE and ("fused-adam", dtype) not in cpu_lists._failed


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`step_list` steps ``dtype`` weights (fp32, bf16) as torch's fused Adam(W) does here: its kernel
    builds, and a probe of a few steps of tensors of several sizes (vector loops, tails of whole groups and of single
    values, a chunk boundary; AdamW's and Adam's decays, maximize, a beta1 past 0.5) comes out bitwise equal to
    torch's fused step, with (fp32 weights) bf16 copies equal to ``copy_``'s. Once per process and dtype."""
    return dtype in _STORAGE and aten_lists._probed(("fused-adam", dtype), _probe, dtype)


def supports(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group`` steps with the arithmetic the kernel has: fused, not amsgrad, capturable or differentiable,
    a float learning rate, and no GradScaler's scale handed to the step (``grad_scale``, ``found_inf``)."""
    if not group.get("fused") or group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
        return False
    if isinstance(group["lr"], torch.Tensor):
        return False
    return getattr(optimizer, "grad_scale", None) is None and getattr(optimizer, "found_inf", None) is None


def scalars(group: dict[str, Any], step: float, decoupled: bool) -> tuple[torch.Tensor, int]:
    """The kernel's scalars and flags for ``group`` at ``step``, made as torch's fused step makes them: in doubles
    (the root of the second bias correction a square root), each narrowed to fp32."""
    values, flags = aten_lists.adam_values(group, step, decoupled, math.sqrt)
    return torch.tensor(values, dtype=torch.float32), flags


def table(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> cpu_lists.Table:
    """The kernel's table of ``rows`` (weight, gradient, exp_avg, exp_avg_sq, bf16 copy or None): their addresses
    and sizes, a row each (the gradients' in column ``aten_lists.GRADS``)."""
    return cpu_lists.Table(
        [
            [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), 0 if c is None else c.data_ptr()]
            for p, g, m, v, c in rows
        ]
    )


def step_table(table: cpu_lists.Table, dtype: torch.dtype, group: dict[str, Any], step: float, decoupled: bool) -> None:
    """:func:`step_list` of the rows a :func:`table` holds (``dtype`` tensors)."""
    values, flags = scalars(group, step, decoupled)
    _compiled(dtype)(table.tensor, table.rows, values, flags)


def step_list(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    group: dict[str, Any],
    step: float,
    decoupled: bool,
) -> None:
    """torch's fused Adam(W) step of every ``(weight, gradient, exp_avg, exp_avg_sq, bf16 copy or None)`` of ``rows``
    (CPU tensors of one dtype, ``aten_lists.takes``; a copy, of fp32 weights only, contiguous, of the weight's size)
    at step count ``step`` (already counted) with ``group``'s options, in one call, bit for bit (``decoupled``:
    AdamW's decay); each copy written with its weight. Call where :func:`available` and :func:`supports`."""
    step_table(table(rows), rows[0][0].dtype, group, step, decoupled)


def _probe(dtype: torch.dtype) -> None:
    _compiled(dtype)
    g = torch.Generator().manual_seed(0)
    sizes = (1, 7, 15, 16, 23, 31, 47, 63, aten_lists.CHUNK_VALUES + 29, 250007)  # the last: rare roundings show
    cases: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
        (torch.optim.AdamW, {"weight_decay": 0.1, "lr": 0.3}),
        (torch.optim.AdamW, {"betas": (0.9, 0.95)}),
        (torch.optim.Adam, {"maximize": True, "betas": (0.3, 0.99)}),
        (torch.optim.Adam, {"weight_decay": 0.01}),
    ]
    for kind, options in cases:
        weights = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        mine, theirs = [w.clone() for w in weights], [w.clone() for w in weights]
        copies = [torch.empty(n, dtype=torch.bfloat16) if dtype is torch.float32 else None for n in sizes]
        options = {"lr": 1e-2, **options}
        ours, torchs = kind(mine, **options), kind(theirs, fused=True, **options)  # type: ignore[arg-type,call-arg]
        group = ours.param_groups[0]
        for step in range(1, 4):
            grads = [(torch.randn(n, generator=g) * 1e-2).to(dtype) for n in sizes]
            for w, gw in zip(theirs, grads, strict=True):
                w.grad = gw.clone()
            torchs.step()
            rows: list[Any] = []
            for w, gw, c in zip(mine, grads, copies, strict=True):
                st = ours.state[w]
                if not st:
                    st.update(exp_avg=torch.zeros_like(w), exp_avg_sq=torch.zeros_like(w))
                rows.append((w, gw, st["exp_avg"], st["exp_avg_sq"], c))
            step_list(rows, group, float(step), kind is torch.optim.AdamW)
        for a, b, c in zip(mine, theirs, copies, strict=True):
            sa, sb = ours.state[a], torchs.state[b]
            same = torch.equal(a, b) and torch.equal(sa["exp_avg"], sb["exp_avg"])
            same = same and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
            if not same or (c is not None and not torch.equal(c, b.to(torch.bfloat16))):
                raise RuntimeError(f"the {dtype} fused Adam(W) kernel does not step as torch's fused step here")
