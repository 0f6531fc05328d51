"""Stochastic rounding's noise: fp32 rounded to bf16 unbiased, with noise from integers alone.

The noise is a pure function of a seed, a step counter, the tensor's position in the optimizer
and each element's index in the *whole* tensor (a Weyl sequence), so a checkpoint carries it
and a weight sharded by FSDP2 rounds as it would in one process. The seed and the counter are host integers, so a
CUDA graph would replay one step's noise at every step: :func:`refuse_capture` says so where a step is captured.
Nothing here syncs with the device but :func:`draw_seed` (one broadcast under a process group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec._src import sharding

__all__ = [
    "draw_seed",
    "refuse_capture",
    "seed_tensor",
    "seeds_from",
    "shard_seed",
    "sr_bits",
    "stochastic_round",
    "stochastic_write",
    "tensor_seed",
]


def refuse_capture() -> None:
    """Raise where a CUDA graph is being captured: the step's noise comes from host integers (a seed and a step
    count), which every replay of the graph would reuse, so the rounding would repeat one pattern, biased, step after
    step. A host-side check, no sync."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "bf16-sr's stochastic rounding cannot be captured in a CUDA graph: its noise comes from a seed and a step "
            "count kept on the host, so every replay would round with the captured step's noise. Capture the forward "
            "and backward only and call optimizer.step() outside the graph (torch.compile already runs it eagerly), "
            "or train with level 'bf16-kahan', whose rounding has no noise"
        )


def stochastic_round(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up with probability equal to the discarded fraction (unbiased).

    ``noise`` holds uniform random integers in [0, 2**16) (int32, ``x``'s shape or broadcastable);
    drawn with torch's generator when not given.

    Example:
        >>> import torch, mixprec
        >>> x = torch.full((100_000,), 1.0 + 2**-10)          # between two bf16 values
        >>> y = mixprec.stochastic_round(x).float()
        >>> sorted(y.unique().tolist())
        [1.0, 1.0078125]
        >>> abs(y.mean().item() - (1.0 + 2**-10)) < 2e-4     # on average, the fp32 value
        True
    """
    if x.dtype is not torch.float32:
        raise TypeError(f"stochastic_round takes an fp32 tensor, got {x.dtype}")
    if noise is None:
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    bits = x.contiguous().view(torch.int32)
    # Adding the noise below the kept 16 bits carries into them with probability equal to the
    # discarded fraction; masking then truncates. On the magnitude bits, so negatives round alike.
    rounded = (bits + noise) & -(1 << 16)
    finite = torch.isfinite(x)
    return torch.where(finite, rounded.view(torch.float32), x).to(torch.bfloat16)


# Noise for stochastic rounding: a Weyl sequence, element i of a tensor gets the high 16 bits of
# (i * 0x9E3779B1 + seed) mod 2**32. With the seed uniform and fresh for every tensor and step, each
# element's noise is uniform on [0, 2**16) and independent from step to step, so the rounding is
# unbiased; neighbouring elements get evenly spread, not independent, noise (a dither). Computed
# in place from the index: no buffer to read and no generator call per element (torch's CPU
# generator makes about 200 M integers a second, slower than the optimizer step itself).
_WEYL = -1640531535  # 0x9E3779B1 (2**32 / golden ratio) as an int32
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


def _int32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def tensor_seed(base: int, step: int, index: int) -> int:
    """The 32-bit seed of the tensor at ``index`` in the optimizer, at the group's ``step``.

    splitmix64's finaliser over the three integers: independent-looking, uniform values for
    every (step, index), computed on the host (Python ints never wrap).
    """
    z = (base + step * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _int32((z ^ (z >> 31)) >> 32)


def shard_seed(seed: int, tensor: torch.Tensor) -> int:
    """``seed`` moved along the Weyl sequence to where ``tensor``'s local shard starts.

    Element ``i`` of the shard is element ``offset + i`` of the whole tensor, and
    ``(offset + i) * W + seed == i * W + (seed + offset * W)``: the shard rounds its elements as
    the whole tensor would. Shards that are not one run of the whole (other placements) start
    from the seed mixed with their offsets, which keeps the rounding unbiased.
    """
    where = sharding.flat_offset(tensor)
    if where is None:
        return seed
    offset, contiguous = where
    if not contiguous:  # not one run of the whole tensor: a distinct seed per shard
        return tensor_seed(seed, 0, offset + 1)
    return moved(seed, offset)


def moved(seed: int, offset: int) -> int:
    """``seed`` moved ``offset`` elements along the Weyl sequence: element ``i`` then rounds as element
    ``offset + i`` did with ``seed``."""
    return _int32(seed + offset * _WEYL)


def seed_tensor(seed: int, device: torch.device) -> torch.Tensor:
    """``seed`` as an int32 scalar on ``device`` (a host-to-device copy, no sync)."""
    value = torch.tensor(seed, dtype=torch.int32)
    return value if device.type == "cpu" else value.to(device, non_blocking=True)


def sr_bits(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (contiguous) stochastically rounded to bf16 precision, as fp32 bits with 16 low zeros; element
    ``i`` in flat order gets the noise of flat position ``i``, whatever ``x``'s shape.

    The position times the Weyl constant is summed per dimension, each index times ``stride * W`` wrapped to
    32 bits (the same value mod 2**32): inductor folds ``(row * cols + col) * W`` into one constant per index,
    which overflows int32 in a Triton kernel (``cols * W``) where the wrapped constants do not.
    """
    weyl = torch.zeros((), dtype=torch.int32, device=x.device)
    for dim, (size, stride) in enumerate(zip(x.shape, x.stride(), strict=True)):
        index = torch.arange(size, dtype=torch.int32, device=x.device) * _int32(stride * _WEYL)
        weyl = weyl + index.view([-1 if d == dim else 1 for d in range(x.dim())])
    noise = ((weyl + seed) >> 16) & 0xFFFF
    return (x.view(torch.int32) + noise) & -(1 << 16)


def seeds_from(seed: int, device: torch.device) -> Callable[[int], torch.Tensor]:
    """Offset -> the seed tensor that rounds element ``i`` as element ``offset + i`` of the tensor ``seed`` rounds."""
    return lambda offset: seed_tensor(moved(seed, offset), device)


def stochastic_write(seed: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``write(p, new)``: the bf16 tensor ``p`` set to ``new`` (fp32) rounded stochastically with ``seed``'s noise."""

    def write(p: torch.Tensor, new: torch.Tensor) -> None:
        bits = sr_bits(new.reshape(-1), seed_tensor(seed, p.device))  # fp32 bits, 16 low zeros: exact in bf16
        p.copy_(bits.view(torch.float32).view(p.shape))

    return write


def draw_seed(group: Any = None) -> int:
    """A seed from torch's CPU generator (``torch.manual_seed`` repeats it).

    With ``group`` (the process group of a sharded model) every rank takes rank 0's, one
    broadcast: shards then round as one process would. Replicas (DDP) that must stay bitwise
    equal need every rank's generator seeded alike before :func:`mixprec.prepare`, as DDP
    training scripts do.
    """
    seed = int(torch.randint(0, 1 << 62, ()))
    if group is not None and dist.get_world_size(group) > 1:
        box: list[Any] = [seed]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        seed = int(box[0])
    return seed
