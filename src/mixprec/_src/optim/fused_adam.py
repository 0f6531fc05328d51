"""Adam(W)'s step with quantized moments as one compiled kernel: ``adam.adam_step``'s arithmetic, fused.

:func:`adam_step` takes what ``adam.adam_step`` takes and computes the same values, operation for
operation (the moments dequantized, updated, quantized again in blocks; the weight updated), in
one pass over the parameter's blocks compiled by inductor. Shapes are ``(blocks, block size)`` with
the number of blocks dynamic, so one compiled graph serves every parameter of a format; the block
size is static, which keeps each block's maximum a vectorized reduction. A parameter's last,
partial block (and under FSDP2 the blocks its shard makes room for) runs through the same graph
on a padded copy. On the CPU the step goes through :mod:`cpu_adam` instead (a block at a time in
the L1 cache, about 1.5x faster than this graph; bitwise the eager step's moments), and the graph is
not compiled: it serves other devices. :func:`runs` says whether either runs; where neither does (no
C++ toolchain), the caller takes the eager step. Nothing here syncs with the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mixprec._src import dispatch_modes
from mixprec._src.numerics import bf16_nearest, fp32_nearest, fp32_pow
from mixprec._src.optim import cpu_adam, moments
from mixprec._src.optim import quantize as q
from mixprec._src.optim.adam import quantized_moments
from mixprec._src.optim.state_precision import StatePrecision

__all__ = ["adam_step", "available", "host_step_scalars", "runs", "step_scalars"]

#: ``rounding(values, seed) -> bits``: writes fp32 values to bf16 weights (bits of fp32 with 16 low zeros)
Rounding = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == StatePrecision.FP8:
        return codes.float() * scale[:, None]
    if fmt == StatePrecision.INT4:
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(codes.shape[0], -1)
    return table[codes.int()] * scale[:, None]


def _quantize(x: torch.Tensor, fmt: str, signed: bool, lookup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1).clamp(min=1e-12)
    if fmt == StatePrecision.FP8:
        scale = scale / torch.finfo(q.FP8).max
        scaled = x / scale[:, None]
        if not signed:  # e4m3's smallest positive value for a positive second moment that would round to 0
            # (at or below 2**-10, half of it: compared before the cast, as inductor elides a cast's round trip)
            scaled = torch.where((scaled > 0) & (scaled <= 2.0**-10), 2.0**-9, scaled)
        return scaled.to(q.FP8), scale
    scaled = x / scale[:, None]
    codes = q.lookup_codes(scaled, lookup)
    if not signed and fmt == StatePrecision.INT8:  # the codebook's zero is not a positive second moment's code
        codes = torch.where((scaled > 0) & (codes == 0), 1, codes)
    codes = codes.to(torch.uint8)
    if fmt == StatePrecision.INT4:
        codes = (codes[:, ::2] << 4) | codes[:, 1::2]
    return codes, scale


def _kernel(
    p: torch.Tensor,
    g: torch.Tensor,
    m_codes: torch.Tensor,
    m_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    lookups: list[torch.Tensor],
    scalars: torch.Tensor,
    seed: torch.Tensor,
    comp: torch.Tensor | None,
    fmt: str,
    decoupled: bool,
    rounding: Rounding | None,
) -> None:
    """One step over ``(blocks, block)`` views, in place.

    Padding (zero weights and gradients past a parameter's values) needs no mask: the eager step stores it as
    the code of 0, which every codebook but the 4-bit second moment's dequantizes to 0; that one (no zero
    entry) gives a sixteenth of the block's scale, which the step decays and stores as the same code, below
    every real value of the block (each is at least as much), so no scale changes either.
    """
    m_table, m_lookup, v_table, v_lookup = lookups
    lr, weight_decay, one_minus_beta1, one_minus_beta2, bias_correction1, bias_correction2_sqrt, eps = scalars.unbind()
    p32, g32 = p.float(), g.float()
    if decoupled:
        p32 = p32 - weight_decay * p32  # weight_decay holds lr * weight_decay here, as adam_step computes it
    else:
        g32 = g32 + weight_decay * p32
    m = _dequantize(m_codes, m_scale, m_table, fmt).lerp(g32, one_minus_beta1)
    v = _dequantize(v_codes, v_scale, v_table, fmt).lerp(g32.square(), one_minus_beta2)
    codes, scale = _quantize(m, fmt, True, m_lookup)
    m_codes.copy_(codes)
    m_scale.copy_(scale)
    codes, scale = _quantize(v, fmt, False, v_lookup)
    v_codes.copy_(codes)
    v_scale.copy_(scale)
    denom = (v.sqrt() / bias_correction2_sqrt) + eps
    new = p32 - lr * (m / bias_correction1) / denom
    if comp is not None:  # Kahan: what rounding to bf16 drops is kept in comp (prepare's kahan.write)
        s = p32 + ((new - p32) + comp.float())
        rounded = bf16_nearest(s)  # not s.to(bf16): inductor would keep s in fp32, and comp would stay zero
        p.copy_(rounded)
        comp.copy_(s - rounded)
    elif rounding is None:
        p.copy_(new)
    else:
        p.copy_(rounding(new, seed).view(torch.float32))  # (blocks, block): see sr_noise.sr_bits


#: blocks a call of the kernel steps at most: the fp32 buffers it makes are this many blocks' (about 4 MiB
#: at 8 bits), not the largest parameter's, and a call still spans enough values that its overhead is small
_CHUNK = 1024
#: CPU tensors step through ``cpu_adam``'s kernel (a block at a time, bitwise the eager step's moments), not
#: this graph; the tests of the graph turn it off
NATIVE = True
#: indices into the codebooks and lookup tables are in range by construction (uint8 codes, clamped rows): no
#: bounds check per vector of them; and the threads are OpenMP's to choose at each call: with a number of blocks
#: that is dynamic, inductor otherwise decides from the first call's, and a graph first compiled for a small
#: parameter ran every later one on one thread (2x slower on two cores)
_OPTIONS: dict[str, Any] = {"assert_indirect_indexing": False, "cpp.dynamic_threads": True}
_compiled: Callable[..., None] | None = None
_failed = False


def available() -> bool:
    """Whether the compiled kernel runs here (compiled once per process, at the first call)."""
    global _compiled, _failed
    if _compiled is None and not _failed:
        try:
            compiled = torch.compile(_kernel, fullgraph=True, dynamic=False, options=_OPTIONS)
            _probe(compiled)
            _compiled = compiled
        except Exception:  # no C++ toolchain, an unsupported platform: the eager step
            _failed = True
    return _compiled is not None


def _probe(compiled: Callable[..., None]) -> None:
    """Compile the 8-bit AdamW graph once on a throwaway parameter (under no_grad, as steps run)."""
    p, g = torch.zeros(4 * 256), torch.zeros(4 * 256)
    state: dict[str, Any] = {}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    _step(compiled, p, g, state, group, True, "8bit", p.numel(), None, None, None, native=False)


@functools.cache
def _lookups(fmt: str, device: torch.device) -> list[torch.Tensor]:
    if fmt == StatePrecision.FP8:
        empty = torch.zeros(2, device=device)
        return [empty, empty.int()] * 2
    bits = moments.FORMATS[fmt][0]
    tables = []
    for signed in (True, False):
        tables += [q.table(bits, signed, device), q.code_lookup(bits, signed, device)]
    return tables


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    return t.view(-1, block)


@torch.no_grad()
def adam_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    decoupled: bool,
    precision: str,
    capacity: int = 0,
    rounding: Rounding | None = None,
    seed_at: Callable[[int], torch.Tensor] | None = None,
    comp: torch.Tensor | None = None,
) -> None:
    """``adam.adam_step`` compiled (call where :func:`runs`); ``p`` and ``grad`` contiguous.

    ``rounding`` and ``seed_at`` (bf16-sr): the weight is written as ``rounding(values, seed_at(offset))``
    for the values from flat position ``offset`` on. ``comp`` (bf16-kahan): the weight's compensation,
    written as ``kahan.write`` writes it. Else the weight is rounded to nearest.
    """
    native = NATIVE and cpu_adam.available(precision, p, grad)
    assert native or _compiled is not None, "call runs() first"
    _step(_compiled, p, grad, state, group, decoupled, precision, capacity, rounding, seed_at, comp, native)


def step_scalars(group: dict[str, Any], step: torch.Tensor, decoupled: bool, device: torch.device) -> torch.Tensor:
    """The seven scalars of step ``step`` (counted) of ``group``: lr, the weight decay as applied, 1 - beta1,
    1 - beta2, the two bias corrections (the second's root), eps; fp32, on ``device``.

    Each is the value torch's fp32 ops make of it (``lr * weight_decay`` an fp32 product, made here on the host:
    the product of two fp32 values is exact in a double, so one rounding to fp32 is the fp32 multiply's); the bias
    corrections of both betas in one ``pow`` (a tensor of two values is ATen's element-wise loop, as one is).
    Seven ops a call, nothing read back."""
    lr, applied, beta1, beta2, eps = _group_values(group, decoupled)
    here = step.device  # the count's (torch's capturable Adam keeps it on the parameter's device)
    scalars = torch.tensor([lr, applied, 1 - beta1, 1 - beta2, 0.0, 0.0, eps], dtype=torch.float32, device=here)
    corrections = 1 - torch.tensor([beta1, beta2], dtype=step.dtype, device=here) ** step
    corrections[1:].sqrt_()
    scalars[4:6] = corrections
    return scalars.to(device)


def _group_values(group: dict[str, Any], decoupled: bool) -> tuple[float, float, float, float, float]:
    """``group``'s lr, weight decay as applied (decoupled: ``lr * weight_decay`` as the fp32 multiply makes it),
    betas and eps, as host numbers."""
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    applied = fp32_nearest(fp32_nearest(lr) * fp32_nearest(weight_decay)) if decoupled else weight_decay
    return lr, applied, beta1, beta2, float(group["eps"])


def host_step_scalars(group: dict[str, Any], count: float, decoupled: bool) -> torch.Tensor | None:
    """:func:`step_scalars` of an fp32 CPU step count ``count`` (held on the host), in three ops instead of seven:
    the bias corrections made on the host (``powf``, as ATen's loop makes one value; ``1 - x`` exact in a double,
    then rounded once), the second's root by torch's ``sqrt`` (MKL's, not correctly rounded: the host's would differ
    in the last place). ``None`` where the C library's ``powf`` is not found: the caller takes :func:`step_scalars`."""
    powf = fp32_pow()
    if powf is None:
        return None
    lr, applied, beta1, beta2, eps = _group_values(group, decoupled)
    corrections = [fp32_nearest(1.0 - powf(fp32_nearest(b), count)) for b in (beta1, beta2)]
    scalars = torch.tensor([lr, applied, 1 - beta1, 1 - beta2, *corrections, eps], dtype=torch.float32)
    scalars[5:6].sqrt_()
    return scalars


def runs(precision: str, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether :func:`adam_step` runs for these tensors: ``cpu_adam``'s kernel on the CPU (the graph is then not
    compiled at all), else the compiled graph where inductor compiles, and no Python dispatch mode is active (compiled
    code refuses to run under one: the eager step runs there)."""
    return (NATIVE and cpu_adam.available(precision, p, grad)) or (not dispatch_modes.active() and available())


def _step(
    kernel: Callable[..., None] | None,
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    decoupled: bool,
    precision: str,
    capacity: int,
    rounding: Rounding | None,
    seed_at: Callable[[int], torch.Tensor] | None,
    comp: torch.Tensor | None,
    native: bool,
) -> None:
    capacity = max(capacity, p.numel())
    quantized_moments(state, p, precision, capacity)
    state["step"] += 1
    scalars = step_scalars(group, state["step"], decoupled, p.device)
    if native:  # on the CPU: a block at a time
        mode = cpu_adam.rounding_mode(stochastic=rounding is not None, compensated=comp is not None)
        seed = 0 if seed_at is None else int(seed_at(0))  # rounding is sr_bits: the noise of flat position i
        cpu_adam.adam_step(p, grad, state, scalars, decoupled, precision, mode, seed, comp)
        return
    assert kernel is not None
    bits, block = moments.FORMATS[precision]
    fmt = precision
    lookups = _lookups(fmt, p.device)
    per_block = block * bits // 8  # code bytes a block holds
    tensors = [state["exp_avg_codes"], state["exp_avg_scale"], state["exp_avg_sq_codes"], state["exp_avg_sq_scale"]]
    flat_p, flat_g = p.view(-1), grad.view(-1)
    whole = p.numel() // block  # blocks of real values only
    no_seed = torch.zeros((), dtype=torch.int32, device=p.device)

    flat_c = None if comp is None else comp.view(-1)

    def run(p2: torch.Tensor, g2: torch.Tensor, c2: torch.Tensor | None, first: int, last: int, offset: int) -> None:
        m_codes, m_scale, v_codes, v_scale = tensors
        views = [
            m_codes[first * per_block : last * per_block].view(-1, per_block),
            m_scale[first:last],
            v_codes[first * per_block : last * per_block].view(-1, per_block),
            v_scale[first:last],
        ]
        for view in (p2, g2, *views, *([] if c2 is None else [c2])):
            torch._dynamo.maybe_mark_dynamic(view, 0)
        seed = seed_at(offset) if seed_at is not None else no_seed
        # A graph per format, Adam or AdamW, weight dtype, rounding, and one block or more (dynamo specializes a
        # size of 1): up to 48, more than dynamo's default limit of recompiles of one function.
        with torch._dynamo.config.patch(
            recompile_limit=64, accumulated_recompile_limit=max(torch._dynamo.config.accumulated_recompile_limit, 256)
        ):
            kernel(p2, g2, *views, lookups, scalars, seed, c2, fmt, decoupled, rounding)

    for first in range(0, whole, _CHUNK):  # in chunks: inductor keeps a chunk's fp32 moments in buffers
        last = min(whole, first + _CHUNK)
        span = slice(first * block, last * block)
        c2 = None if flat_c is None else _blocks(flat_c[span], block)
        run(_blocks(flat_p[span], block), _blocks(flat_g[span], block), c2, first, last, first * block)
    total = tensors[1].numel()
    if total > whole:  # the last partial block and the room a shard makes: through a padded copy
        start = whole * block
        rest = (total - whole) * block
        p_rest = torch.zeros(rest, dtype=p.dtype, device=p.device)
        g_rest = torch.zeros(rest, dtype=grad.dtype, device=grad.device)
        tail = p.numel() - start
        p_rest[:tail].copy_(flat_p[start:])
        g_rest[:tail].copy_(flat_g[start:])
        c_rest = None
        if flat_c is not None:
            c_rest = torch.zeros(rest, dtype=flat_c.dtype, device=flat_c.device)
            c_rest[:tail].copy_(flat_c[start:])
        run(
            _blocks(p_rest, block),
            _blocks(g_rest, block),
            None if c_rest is None else _blocks(c_rest, block),
            whole,
            total,
            start,
        )
        flat_p[start:].copy_(p_rest[:tail])
        if flat_c is not None and c_rest is not None:
            flat_c[start:].copy_(c_rest[:tail])
