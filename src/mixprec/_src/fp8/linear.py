"""A layer of a linear kind that computes its three GEMMs in fp8, and its scaling state.

:func:`mixprec.prepare` converts a linear in place: its ``forward`` becomes :func:`fp8_forward`
and it gains a child ``fp8`` (:class:`Fp8Scaling`). Parameters, their names and the state dict of
the dynamic recipes stay those of the ``nn.Linear`` (an fp8 checkpoint is a bf16 one);
delayed scaling adds two fp32 buffers, ``fp8.history`` and ``fp8.pending``.

Delayed scaling (Transformer Engine's algorithm)::

    scale[t]   = fp8_max / algo(history[t]) / 2**margin   # algo: max, or most recent; first step: current amax
    pending   <- max(pending, amax of this call's tensor)  # each forward and backward of step t
    at the optimizer step: history <- [pending, history[:-1]]; pending <- 0

Recording is a max, so a recompute (activation checkpointing) or a second micro-batch
neither advances the history nor changes the scale used within a step; the history advances
once per optimizer step (a hook prepare installs), after the amax is all-reduced across ranks.

The output gradient is read for its amax once a backward: its second cast takes its first one's scale
(:func:`same_scale`: where the recipe casts it to one format with one scale both times), the same bits as reading it
again. Nothing here syncs with the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from mixprec._src.amp.autocast import get_autocast_policy
from mixprec._src.fp8 import block_gemm, fused_cast
from mixprec._src.fp8 import gemm as fp8_gemm
from mixprec._src.fp8.config import AmaxAlgo, Fp8Config, Operand
from mixprec._src.gemms import kinds
from mixprec._src.policy.rules import OpCategory

__all__ = ["ROLES", "CastStats", "compute_dtype", "fp8_forward", "Fp8Scaling", "scale_from_history"]

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
ROLES = ("input", "weight", "grad_output")


@dataclasses.dataclass
class CastStats:
    """One cast of one tensor of an fp8 layer (tensors, read only when shown: no sync until then).

    Attributes:
        amax: largest magnitude (per-row amaxes: their max).
        scale: the scale applied before the cast (per-row: their min).
        saturated: fraction of values that overflow the format after scaling (clamped to its max).
        flushed: fraction of non-zero values that became zero (underflow).
    """

    amax: torch.Tensor
    scale: torch.Tensor
    saturated: torch.Tensor
    flushed: torch.Tensor

    @staticmethod
    def of(t: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> CastStats:
        with torch.no_grad():
            scaled = t.float() * scale
            limit = fp8_gemm.fp8_max(dtype)
            q = scaled.clamp(-limit, limit).to(dtype)
            saturated = (scaled.abs() > fp8_gemm.saturation_threshold(dtype)).float().mean()
            flushed = ((t != 0) & (q == 0)).float().mean()
        return CastStats(amax.max(), scale.min(), saturated, flushed)

    def as_floats(self) -> dict[str, float]:
        """Host numbers (syncs with the device)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


_FWD_ROLES, _BWD_ROLES = ("input", "weight"), ("grad_output",)
_STAT_COLUMNS = 5  # CastStats' four fields, then 1 where the role was recorded


class Fp8Scaling(nn.Module):
    """An fp8 linear's recipe and, with delayed scaling, its amax history (fp32 buffers).

    While ``recording`` is on (diagnose, the monitor and the guard turn it on) each cast writes its
    statistics into ``cast_fwd`` (input, weight) and ``cast_bwd`` (grad_output): per role, amax, scale,
    saturated and flushed fractions and a recorded flag, the last call's. They are non-persistent
    buffers written in place inside the GEMMs' autograd Function, so torch.compile traces the
    recording into the graph. :attr:`stats` reads them as :class:`CastStats` (one sync).
    """

    stochastic = False  # nvfp4's gradient casts round stochastically (set per instance; older pickles: none)
    history: torch.Tensor  # (3, history_len) fp32: per role, the amax of past steps, newest first
    pending: torch.Tensor  # (3,) fp32: per role, the largest amax seen in this step

    def __init__(self, config: Fp8Config, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.recording = False
        self.register_buffer("cast_fwd", torch.zeros(len(_FWD_ROLES), _STAT_COLUMNS, device=device), persistent=False)
        self.register_buffer("cast_bwd", torch.zeros(len(_BWD_ROLES), _STAT_COLUMNS, device=device), persistent=False)
        if config.delayed:
            self.register_buffer("history", torch.zeros(3, config.history_len, device=device))
            self.register_buffer("pending", torch.zeros(3, device=device))
        rounded = (config.operands.grad_output.block, config.operands.grad_output_for_grad_weight.block)
        #: the output gradient's casts round stochastically (nvfp4's recipe)
        self.stochastic = any(b is not None and b.stochastic for b in rounded)
        if self.stochastic:  # stochastic rounding's (salt, counter): the salt drawn from torch's generator
            salt = int(torch.randint(0, 2**31, ()))
            self.register_buffer("noise", torch.tensor([salt, 0], dtype=torch.int64, device=device))

    def extra_repr(self) -> str:
        return str(self.config).removeprefix("fp8 ")

    def _rows(self) -> torch.Tensor:
        """Every role's row: input, weight, grad_output."""
        return torch.cat([self.cast_fwd, self.cast_bwd])  # type: ignore[list-item]

    @property
    def stats(self) -> dict[str, CastStats]:
        """The last recorded cast of each role (``input``, ``weight``, ``grad_output``); reads the flags (a sync)."""
        rows = self._rows()
        recorded = rows[:, -1].tolist()
        return {
            role: CastStats(*rows[i, :-1].unbind()) for i, role in enumerate(_FWD_ROLES + _BWD_ROLES) if recorded[i] > 0
        }

    def cast_fractions(self) -> torch.Tensor:
        """The largest saturated and flushed fractions over the recorded casts, shape (2,): no sync."""
        return self._rows()[:, 2:4].amax(dim=0)

    @torch.no_grad()
    def clear_stats(self) -> None:
        """Forget the recorded casts (in place, no sync)."""
        self.cast_fwd.zero_()  # type: ignore[operator]
        self.cast_bwd.zero_()  # type: ignore[operator]

    @torch.no_grad()
    def advance(self) -> None:
        """End of an optimizer step: the pending amax joins the history (delayed scaling; in place, no sync)."""
        if self.config.delayed:
            self.history.copy_(torch.roll(self.history, 1, dims=1))
            self.history[:, 0] = self.pending
            self.pending.zero_()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        missing: list[str] = args[2]
        saved = state_dict.get(prefix + "history")
        if self.config.delayed and saved is not None and saved.shape != self.history.shape:
            # A history of another length: its newest entries, as many as this one holds (zeros after).
            resized = torch.zeros_like(self.history)
            keep = min(saved.shape[-1], resized.shape[-1])
            resized[:, :keep] = saved[:, :keep]
            state_dict[prefix + "history"] = resized
        super()._load_from_state_dict(state_dict, prefix, *args)
        # A checkpoint of a recipe without an amax history (bf16, a dynamic fp8 recipe) starts one afresh, and one
        # without stochastic rounding's counter keeps this layer's.
        absent = {prefix + "history", prefix + "pending", prefix + "noise"} - state_dict.keys()
        missing[:] = [key for key in missing if key not in absent]


@dataclasses.dataclass(frozen=True)
class _Delayed:
    margin: int
    algo: AmaxAlgo
    record: bool  # the forward records amaxes (grad mode on: training, not an evaluation under no_grad)


def scale_from_history(
    row: torch.Tensor, now: torch.Tensor, dtype: torch.dtype, algo: AmaxAlgo, margin: int
) -> torch.Tensor:
    """Delayed scaling's scale from one tensor's amax history (``now``, its amax, while the history is empty)."""
    past = row.amax() if algo is AmaxAlgo.MAX else row[0]
    return fp8_gemm.scale_from_amax(torch.where(past > 0, past, now), dtype, power_of_two=False, margin=margin)


def _delayed_scale(
    history: torch.Tensor,
    pending: torch.Tensor,
    role: int,
    t: torch.Tensor,
    dtype: torch.dtype,
    delayed: _Delayed,
    record: bool = True,
) -> torch.Tensor:
    """The scale of ``role`` from past steps (the current amax before any); ``record``: note the current amax."""
    if (  # CUDA, eager: two launches, the same bits (an fp32 or bf16 history: a model's .to() may narrow it)
        history.dtype in (torch.float32, torch.bfloat16)
        and pending.dtype is history.dtype
        and fused_cast.usable(t, dtype, rowwise=False, power_of_two=False)
    ):
        return fused_cast.delayed_scale(
            t.detach(),
            history[role].contiguous(),
            pending[role],
            dtype,
            most_recent=delayed.algo is AmaxAlgo.MOST_RECENT,
            margin=delayed.margin,
            record=record,
            eps=fp8_gemm.EPS,
        )
    now = t.detach().abs().amax().float()
    if record:
        with torch.no_grad():  # a non-finite amax (an overflowed step GradScaler skips) is not recorded
            pending[role] = torch.maximum(pending[role], torch.where(now.isfinite(), now, 0.0))
    return scale_from_history(history[role], now, dtype, delayed.algo, delayed.margin)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with the output and both gradient GEMMs in fp8, as the recipe says."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        config: Fp8Config,
        delayed: _Delayed | None,
        history: torch.Tensor | None,
        pending: torch.Tensor | None,
        cast_fwd: torch.Tensor | None,
        cast_bwd: torch.Tensor | None,
        noise: torch.Tensor | None,
    ) -> torch.Tensor:
        ops = config.operands
        x2 = x.reshape(-1, x.shape[-1])
        scale_x = scale_w = None
        if delayed is not None:
            assert history is not None and pending is not None
            scale_x = _delayed_scale(
                history,
                pending,
                INPUT,
                x2,
                ops.input.dtype,  # type: ignore[arg-type]
                delayed,
                delayed.record,
            )
            scale_w = _delayed_scale(
                history,
                pending,
                WEIGHT,
                weight,
                ops.weight.dtype,  # type: ignore[arg-type]
                delayed,
                delayed.record,
            )
        record: list[Any] | None = [] if cast_fwd is not None else None
        out = fp8_gemm.gemm(
            x2,
            ops.input,
            weight.t(),
            ops.weight,
            x.dtype,
            fast_accum=True,
            power_of_two=ops.power_of_two_scales,
            scale_a=scale_x,
            scale_b=scale_w,
            record=record,
        )
        if record and cast_fwd is not None:
            _keep_stats(cast_fwd, record)
        # Delayed scaling: the backward casts the input and weight with the forward's scales. (Dynamic scaling reads
        # them again there: saving their scales too would keep two more tensors a call for the backward, which
        # memory_plan counts exactly.)
        ctx.save_for_backward(x, weight, *((scale_x, scale_w) if delayed is not None else ()))
        ctx.config, ctx.delayed, ctx.state, ctx.cast_bwd = config, delayed, (history, pending), cast_bwd
        ctx.noise = noise
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, *forward_scales = ctx.saved_tensors
        scale_x, scale_w = forward_scales or (None, None)
        ops, delayed = ctx.config.operands, ctx.delayed
        power = ops.power_of_two_scales
        seed = None
        if ctx.noise is not None:  # this backward's noise; the next one draws new (a checkpoint carries the count)
            seed = block_gemm.noise_seed(ctx.noise, 0)
            with torch.no_grad():
                ctx.noise[1] += 1
        with _autocast_off(grad.device.type):
            go = grad.reshape(-1, grad.shape[-1])
            scale_go = None
            if delayed is not None:
                history, pending = ctx.state
                scale_go = _delayed_scale(history, pending, GRAD_OUTPUT, go, ops.grad_output.dtype, delayed)
            record: list[Any] | None = [] if ctx.cast_bwd is not None else None
            scales: list[torch.Tensor] = []
            grad_x = fp8_gemm.gemm(
                go,
                ops.grad_output,
                weight,
                ops.weight_for_grad_input,
                x.dtype,
                power_of_two=power,
                scale_a=scale_go,
                scale_b=scale_w,
                record=record,
                seed=seed,
                scales=scales,
            )
            if record:
                _keep_stats(ctx.cast_bwd, record[:1])
            if scale_go is None and scales and same_scale(ops.grad_output, ops.grad_output_for_grad_weight):
                scale_go = scales[0]  # the output gradient's amax is its transpose's: read once
            grad_w = fp8_gemm.gemm(
                go.t(),
                ops.grad_output_for_grad_weight,
                x.reshape(-1, x.shape[-1]),
                ops.input_for_grad_weight,
                weight.dtype,
                power_of_two=power,
                scale_a=scale_go,
                scale_b=scale_x,
                rotate=ops.rotate_grad_weight,
                seed=None if seed is None else seed + 2,
            )
        return grad_x.reshape(x.shape), grad_w, None, None, None, None, None, None, None


def same_scale(first: Operand, again: Operand) -> bool:
    """Whether a tensor cast for ``first`` and then for ``again`` (the output gradient in the backward's two GEMMs)
    is cast with one scale: the same format, one scale for the whole tensor. Dynamic scaling's scale of a tensor is
    a function of its amax, which its transpose and its zero-padded copy share, so the second cast takes the first's
    scale, bit for bit, instead of reading the tensor for its amax again."""
    return (
        first.dtype is not None
        and first.dtype == again.dtype
        and not (first.rowwise or again.rowwise)
        and first.block is None
        and again.block is None
    )


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off around the backward's casts and GEMMs, where ``backward()`` runs inside a region.

    Under torch.compile the backward is traced with the forward, which already runs with autocast
    off; Dynamo refuses an autocast context inside a traced backward, so none is opened there.
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _keep_stats(table: torch.Tensor, record: list[Any]) -> None:
    """Write each recorded cast's statistics into its row of ``table`` (in place: traced by torch.compile)."""
    for row, entry in enumerate(record[: table.shape[0]]):
        if isinstance(entry, block_gemm.BlockRecord):
            stats = CastStats(*block_gemm.cast_stats(entry))
        else:
            stats = CastStats.of(*entry)
        with torch.no_grad():
            table[row] = torch.stack(
                [
                    stats.amax.float(),
                    stats.scale.float(),
                    stats.saturated,
                    stats.flushed,
                    torch.ones((), device=table.device),
                ]
            )


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _linear_category(device_type: str) -> str | None:
    """The policy's category for ``linear`` in the region in force (a constant to torch.compile: the
    region's own graph nodes carry its policy; reading the per-thread stack would guard on it)."""
    category = get_autocast_policy(device_type).category_of("linear")
    return None if category is None else category.value


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would compute in here: autocast's for ``linear`` (policy and rules), else ``x``'s."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        category = _linear_category(device_type)
        if category == OpCategory.LOWER.value:
            return torch.get_autocast_dtype(device_type)
        if category == OpCategory.FP32.value:
            return torch.float32
    return x.dtype


def fp8_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The forward of a converted layer of a linear kind (bound to it by prepare)."""
    weight = kinds.linear_weight(self)  # (out, in): a view of a transposed (Conv1D) or patch kernel's weight
    bias = kinds.bias_of(self)
    if kinds.kind_of(self) is kinds.PATCH:  # a patch convolution: a linear over its patches
        return kinds.unpatch(self, _fp8_linear(self, kinds.patches(self, input), weight, bias), input)
    return _fp8_linear(self, input, weight, bias)


def _fp8_linear(self: nn.Module, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scaling: Fp8Scaling = self.fp8  # type: ignore[assignment]
    config = scaling.config
    dtype = compute_dtype(input)
    if input.numel() == 0:  # no tokens: nothing to scale (an amax of nothing is undefined), nothing recorded
        return torch.nn.functional.linear(input.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    delayed = _Delayed(config.margin, config.amax_algo, torch.is_grad_enabled()) if config.delayed else None
    history = scaling.history if delayed is not None else None
    pending = scaling.pending if delayed is not None else None
    with torch.autocast(input.device.type, enabled=False):  # the GEMMs' dtypes are the recipe's, not autocast's
        stats = (scaling.cast_fwd, scaling.cast_bwd) if scaling.recording else (None, None)
        noise = scaling.noise if scaling.stochastic else None
        args = (input.to(dtype), weight, config, delayed, history, pending, *stats, noise)
        out = _Fp8Matmul.apply(*args)  # type: ignore[no-untyped-call]
        if bias is not None:
            out = out + bias.to(out.dtype)
    return out  # type: ignore[no-any-return]
