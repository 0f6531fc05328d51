"""Adam(W)'s moments and SGD's momentum kept in bf16, stochastically rounded: ``optimizer_state="bf16"``.

DeepSeek-V3's choice (bf16 moments beside fp32 master weights): 2 bytes a moment instead of 4, at any level,
without blocks or scales. A parameter of at least ``optim.moments.MIN_NUMEL`` values keeps its moments as bf16
tensors of its own shape under torch's names (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``: DTensors where
the parameter is one, so ``optimizer.state_dict()`` and ``torch.distributed.checkpoint`` take them as they take
torch's own state), and a step count (``step``; SGD's too, for the noise). Each step reads them into fp32, a
chunk of :data:`CHUNK` values at a time, updates them and the weight in fp32 (``optim.adam.adam_update``,
``optim.sgd.sgd_update``: the quantized states' arithmetic), and writes them back with stochastic rounding: the
rounding of a moment is unbiased, so the small updates of a slowly moving second moment are not lost to
round-to-nearest as they are in a plain bf16 state. The noise is bf16-sr's (``sr_noise``: a Weyl sequence
over each element's index in the whole tensor), from the param group's seed (drawn at prepare), the
parameter's step count, its position in the optimizer and the moment: a resume continues bit for bit and an
FSDP2 shard rounds as one process does. The weight is written as the level writes it (to nearest, bf16-sr's
noise, bf16-kahan's compensation). Smaller parameters keep the level's state and the optimizer's own step.

``load_state_dict`` casts state to the parameter's dtype (fp32 at O1 and O2): :func:`narrow_after_load` puts the
moments back in bf16 (exactly: they were bf16). A checkpoint of fp32 moments is rounded to nearest at its
first step here; one of quantized moments is dequantized, then rounded. Nothing here syncs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec._src import sharding
from mixprec._src.optim import adam, cpu_adam, fused_adam, moments, sgd
from mixprec._src.step.sr_noise import _MASK64, moved, seed_tensor, shard_seed, sr_bits, tensor_seed

__all__ = [
    "CHUNK",
    "NAMES",
    "Writeback",
    "adam_step",
    "moment_key",
    "moment_seed",
    "narrow_after_load",
    "ready_adam",
    "ready_sgd",
    "seed_of",
    "sgd_step",
    "shard_code",
]

#: values read into fp32 at once: a step's fp32 temporaries stay a few of this size
CHUNK = 1 << 18
#: the state tensors kept in bf16, per optimizer kind
NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
#: each moment's noise is its own: the seed is mixed with this before the step and the position
_SALT = {"exp_avg": 0x6D31, "exp_avg_sq": 0x7632, "momentum_buffer": 0x6233}
#: ``(offset, the local weight's values from there) -> (bf16-sr's seed, bf16-kahan's compensation, write)``: how
#: the level writes them (``low_bit_state``'s; ``write(target, new)``, ``None``: rounded to nearest)
Writeback = Callable[[int, torch.Tensor], tuple[int | None, torch.Tensor | None, Any]]


def seed_of(base: int, position: int, p: torch.Tensor) -> Callable[[str, int], int]:
    """``(moment, step) ->`` the seed of element 0 of this rank's shard of ``p``'s ``moment`` at that step count."""
    return lambda name, step: moment_seed(base, position, p, name, step)


def moment_seed(base: int, position: int, p: torch.Tensor, name: str, step: int) -> int:
    """The seed of element 0 of this rank's shard of ``p``'s ``moment`` at step count ``step`` (``p`` at
    ``position`` in an optimizer whose group seed is ``base``)."""
    return shard_seed(tensor_seed(base + _SALT[name], step, position), p)


def moment_key(base: int, name: str) -> int:
    """The 64-bit key of ``name``'s seeds in a group whose seed is ``base`` (as the list kernel takes it: signed)."""
    key = (base + _SALT[name]) & _MASK64
    return key - (1 << 64) if key >= 1 << 63 else key


def shard_code(p: torch.Tensor) -> tuple[int, int]:
    """Where this rank's shard of ``p`` starts, as the list kernel takes it: ``(kind, offset)``, kind 0 for the whole
    tensor, 1 for one run of it from ``offset``, 2 for another placement (``sr_noise.shard_seed``'s three cases)."""
    where = sharding.flat_offset(p)
    if where is None:
        return 0, 0
    offset, contiguous = where
    return (1 if contiguous else 2), offset


def _ready(state: dict[str, Any], p: torch.Tensor, names: tuple[str, ...], first_zero: bool) -> None:
    """``state``'s moments as bf16 tensors of ``p``'s shape (DTensors where ``p`` is one): zeros for a new one
    (SGD's buffer is made by its first step instead), others rounded to nearest, quantized ones dequantized."""
    for name in names:
        value = state.get(name)
        if value is None and f"{name}_codes" in state:  # a checkpoint of quantized state
            values = moments.load(state, name, sharding.local(p).shape)
            del state[f"{name}_codes"], state[f"{name}_scale"]
            value = torch.zeros_like(p, dtype=torch.bfloat16)
            sharding.local(value).copy_(values)
        elif value is None and first_zero:
            value = torch.zeros_like(p, dtype=torch.bfloat16)
        elif value is not None and value.dtype != torch.bfloat16:
            value = value.to(torch.bfloat16)
        if value is not None:
            state[name] = value
    if "step" not in state:  # not setdefault: it would make a tensor at every step
        state["step"] = torch.tensor(0.0)


def ready_adam(state: dict[str, Any], p: torch.Tensor) -> None:
    """``state``'s Adam moments ready for a step in bf16 (made, cast or dequantized) and its step count."""
    _ready(state, p, NAMES["adam"], first_zero=True)


def ready_sgd(state: dict[str, Any], p: torch.Tensor) -> bool:
    """``state``'s momentum buffer ready for a step in bf16 (made as zeros where it is the first step: it is then
    the gradient), and its step count; whether the buffer had started."""
    (name,) = NAMES["sgd"]
    _ready(state, p, (name,), first_zero=False)
    started = name in state
    if not started:
        state[name] = torch.zeros_like(p, dtype=torch.bfloat16)
    return started


def _round_into(target: torch.Tensor, value: torch.Tensor, seed: int) -> None:
    """fp32 ``value`` into bf16 ``target`` stochastically, element ``i`` with the noise of ``seed`` at ``i``."""
    bits = sr_bits(value.contiguous(), seed_tensor(seed, value.device))
    target.copy_(bits.view(torch.float32).view(target.shape))


def _chunks(n: int, flat: bool) -> list[tuple[int, int]]:
    return [(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)] if flat else [(0, n)]


def _part(t: torch.Tensor, flat: bool, first: int, last: int) -> torch.Tensor:
    return t.view(-1)[first:last] if flat else t


def _write_at(writeback: Writeback, first: int, target: torch.Tensor, new: torch.Tensor) -> None:
    write = writeback(first, target)[2]
    if write is None:
        target.copy_(new)
    else:
        write(target, new)


@torch.no_grad()
def adam_step(
    p: torch.Tensor,
    local_p: torch.Tensor,
    local_g: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    decoupled: bool,
    seed: Callable[[str, int], int],
    writeback: Writeback,
) -> None:
    """One Adam (``decoupled=False``) or AdamW step of ``p`` (``local_p``, ``local_g``: this rank's values and
    gradient) with its moments in bf16 in ``state``: on the CPU ``cpu_adam``'s kernel (one pass, no copies),
    elsewhere a chunk at a time on fp32 copies (the same arithmetic and noise)."""
    names = NAMES["adam"]
    ready_adam(state, p)
    state["step"] += 1
    step = state["step"]
    held = [sharding.local(state[name]) for name in names]
    seeds = [seed(name, int(step)) for name in names]
    if fused_adam.NATIVE and cpu_adam.bf16_available(local_p, local_g, *held):
        w_seed, comp, _ = writeback(0, local_p)
        mode = cpu_adam.rounding_mode(stochastic=w_seed is not None, compensated=comp is not None)
        scalars = fused_adam.step_scalars(group, step, decoupled, local_p.device)
        cpu_adam.bf16_adam_step(
            local_p,
            local_g,
            held[0],
            held[1],
            scalars,
            decoupled,
            (seeds[0], seeds[1]),
            mode,
            0 if w_seed is None else w_seed,
            None if comp is None else comp.reshape(-1),
        )
        return
    flat = local_p.is_contiguous() and all(t.is_contiguous() for t in held)
    for first, last in _chunks(local_p.numel(), flat):
        m_old, v_old = (_part(t, flat, first, last) for t in held)
        target = _part(local_p, flat, first, last)
        grad = local_g.reshape(-1)[first:last] if flat else local_g
        # held here for the whole update (how long CPython keeps a callee's rebound argument alive otherwise
        # depends on its call path), and dropped before the next chunk's are made
        copies = (target.float(), grad.float(), m_old.float(), v_old.float())
        m, v, new = adam.adam_update(*copies, step, group, decoupled)
        _round_into(m_old, m, moved(seeds[0], first))
        _round_into(v_old, v, moved(seeds[1], first))
        _write_at(writeback, first, target, new)
        del copies, m, v, new


@torch.no_grad()
def sgd_step(
    p: torch.Tensor,
    local_p: torch.Tensor,
    local_g: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    seed: Callable[[str, int], int],
    writeback: Writeback,
) -> None:
    """One SGD-with-momentum step of ``p`` with its momentum buffer in bf16 in ``state``."""
    (name,) = NAMES["sgd"]
    started = ready_sgd(state, p)
    state["step"] += 1
    held = sharding.local(state[name])
    flat = local_p.is_contiguous() and held.is_contiguous()
    base = seed(name, int(state["step"]))
    for first, last in _chunks(local_p.numel(), flat):
        buf_old, target = _part(held, flat, first, last), _part(local_p, flat, first, last)
        grad = local_g.reshape(-1)[first:last] if flat else local_g
        copies = (target.float(), grad.float(), buf_old.float() if started else None)  # held, as Adam's
        buf, new = sgd.sgd_update(*copies, group)
        _round_into(buf_old, buf, moved(base, first))
        _write_at(writeback, first, target, new)
        del copies, buf, new


def narrow_after_load(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` (which cast every state tensor to its parameter's dtype): the large parameters'
    moments back in bf16."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or p.numel() < moments.MIN_NUMEL:
                continue
            for name in (*NAMES["adam"], *NAMES["sgd"]):
                value = state.get(name)
                if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16:
                    state[name] = value.to(torch.bfloat16)
