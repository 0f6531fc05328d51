"""A training guard: watch each low-precision layer and move one that fails up in precision.

``guard = mixprec.Guard(model, scaler)`` puts light probes on the model's GEMM layers;
``guard.step()`` after each optimizer step reads what they saw (one host sync) and decides::

    per watched layer, signals this step:
        nonfinite_forward   its output is inf/NaN while its input was finite (the first such layer)
        nonfinite_backward  its input or weight gradient is inf/NaN while its output gradient was finite,
                            with the loss scale of that backward at or below ``backward_scale``
                            (above it, the scaler's backoff is the cure, not a move)
        fp16_overflow       an fp16 layer's output amax above ``fp16_margin`` of fp16's largest value
        saturated, flushed  an fp8 cast's fraction of values clamped at the format's max / flushed to zero
                            (block-scaled: the fraction of blocks whose values clamped / of values flushed)
        amax_jump           an fp8 or block-scaled layer's input or output-gradient amax ``amax_jump`` times
                            its peak so far
    strikes[layer] = strikes[layer] + 1 if it has a signal, else 0
    strikes[layer] == patience  ->  the layer moves one rung up the ladder:
        nvfp4 -> mxfp8 -> fp8-tensorwise -> fp8-rowwise -> bf16 -> fp32;  fp8-delayed -> fp8-tensorwise;
        fp16 -> bf16 -> fp32

Moves are decided from the step's statistics alone (all-reduced across ranks where a process
group is up), so every rank and every rerun decides the same; they are logged on
``mixprec.guard`` (WARNING), kept in :attr:`Guard.moves` and in :meth:`Guard.state_dict`, whose
:meth:`Guard.load_state_dict` replays them on a fresh model. Thresholds are data
(:class:`GuardThresholds`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec._src.dtypes import short_name
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.gemms import sites
from mixprec._src.layers import probes
from mixprec._src.layers.ladder import GuardThresholds, LayerMove
from mixprec._src.layers.precision import LayerPrecision, layer_precision, set_layer_precision
from mixprec._src.layers.probes import (
    BAD_WEIGHT_GRAD,
    BWD_ORIGIN,
    FLUSHED,
    FP16_MAX,
    FWD_ORIGIN,
    GRAD_OUT,
    IN,
    KIND,
    KINDS,
    OUT,
    SATURATED,
)

__all__ = ["Guard"]

logger = logging.getLogger("mixprec.guard")


class Guard:
    """Watch a model's GEMM layers during training and move a failing one up in precision.

    Args:
        model: the model (prepared or not; its layers as ``named_modules`` names them).
        scaler: the fp16 run's GradScaler (its scale decides whether a non-finite backward is the layer's).
        thresholds: when to move a layer; default :class:`GuardThresholds`'s.
        names: qualified-name globs of the layers to watch (default: every GEMM layer).
        callback: called with each :class:`LayerMove` (also logged on ``mixprec.guard`` at WARNING).

    Each forward of a watched layer costs two amax reductions, each backward one or two; an fp8 layer
    records its cast statistics (``Monitor(fp8_stats=True)``'s). Nothing syncs until :meth:`step`.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        >>> guard = mixprec.Guard(model)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     loss = model(torch.randn(2, 4)).float().square().mean()
        >>> loss.backward()
        >>> guard.step()
        []
        >>> guard.close()
    """

    def __init__(
        self,
        model: nn.Module,
        scaler: Any = None,
        *,
        thresholds: GuardThresholds | None = None,
        names: str | tuple[str, ...] = ("*",),
        callback: Callable[[LayerMove], None] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Guard watches an nn.Module, got {type(model).__name__}")
        if thresholds is not None and not isinstance(thresholds, GuardThresholds):
            raise TypeError("thresholds is a mixprec.GuardThresholds(...), e.g. GuardThresholds(patience=3)")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"scaler is the run's GradScaler (mixprec's or torch.amp's), got {type(scaler).__name__}")
        if callback is not None and not callable(callback):
            raise TypeError("callback must be callable: callback(move) for each LayerMove")
        self.thresholds = thresholds if thresholds is not None else GuardThresholds()
        patterns = (names,) if isinstance(names, str) else tuple(names)
        watched = [(n, m) for n, m, _ in sites.gemm_layers(model) if n]  # attentions routed: projections watched
        self.layers = {n: m for n, m in watched if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        if not self.layers:
            raise ValueError(
                "the guard found no GEMM layer (linear, Conv1D, attention projection, convolution) to watch; "
                "check names="
            )
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in watched)]
        if unmatched:
            some = ", ".join(n for n, _ in watched[:8]) + (", ..." if len(watched) > 8 else "")
            raise ValueError(f"names {unmatched} match no GEMM layer of the model (watchable: {some})")
        self.model, self.scaler, self.callback = model, scaler, callback
        self.moves: list[LayerMove] = []
        self.steps = 0
        self.strikes: dict[str, int] = dict.fromkeys(self.layers, 0)
        self.peaks: dict[str, list[float]] = {n: [0.0, 0.0] for n in self.layers}  # input, output-gradient
        self.scale = float(scaler.get_scale()) if scaler is not None else 1.0  # the scale of the coming backward
        self._names = list(self.layers)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # The step's statistics, in the columns named at the top: the forward folds into one table, the
        # backward into the other (a tensor the backward reads is never written by the forward after it).
        self._fwd = torch.zeros(len(self._names), 6, device=device)
        self._bwd = torch.zeros(len(self._names), 6, device=device)
        # the open calls of each layer: (input amax, token) of a call whose forward has not returned yet
        self._calls: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = [[] for _ in self._names]
        self._seen: dict[int, str] = {}  # the precision each layer computed in (read from _kind at each step)
        self._kind = torch.zeros(len(self._names), device=device)  # this step's, as codes of KINDS
        self._handles: list[Any] = []
        for index, module in enumerate(self.layers.values()):
            # Traced by torch.compile into the model's graph: device tensors only, no sync, no .grad read.
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(module.register_forward_hook(self._post_hook(index)))
        self._set_recording(True)

    # ----- probes (no sync) -----------------------------------------------------------

    def _pre_hook(self, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
                return None
            x = args[0]
            amax = probes.amax_of(x)
            probes.fold(self._fwd, index, IN, amax)
            if x.requires_grad and torch.is_grad_enabled():
                x, token = probes.ProbeIn.apply(x, self._bwd, index)  # type: ignore[no-untyped-call]
                self._calls[index].append((amax, token))
                return (x, *args[1:])
            self._calls[index].append((amax, None))
            return None

        return hook

    def _post_hook(self, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            call = self._calls[index].pop() if self._calls[index] else None
            if call is None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return None
            x_amax, token = call
            scaling = fp8_conversion.scaling_of(module)
            kind = LayerPrecision.of_recipe(scaling.config.recipe).value if scaling else short_name(out.dtype)
            if kind in KINDS:  # a constant of the trace: a Python dict written here would be guarded on
                with torch.no_grad():
                    self._kind[index] = 1.0 + KINDS.index(kind)
            amax = probes.amax_of(out)
            probes.fold(self._fwd, index, OUT, amax)
            probes.fold(self._fwd, index, FWD_ORIGIN, ~amax.isfinite() & x_amax.isfinite())  # made here
            if not out.requires_grad:
                return None
            if token is None:  # an input that needed no gradient: the output's is still recorded
                token = out.new_zeros((), dtype=torch.float32)
            return probes.ProbeOut.apply(out, token, self._bwd, index)  # type: ignore[no-untyped-call]

        return hook

    def _set_recording(self, on: bool) -> None:
        for module in self.layers.values():
            scaling = fp8_conversion.scaling_of(module)
            if scaling is not None:
                scaling.recording = on

    # ----- the step's decision (one sync) ---------------------------------------------

    def step(self) -> list[LayerMove]:
        """Read the step's statistics, update the strikes, move the layers that reached ``patience``.

        Call once per optimizer step, after it (and after ``scaler.update()``). Syncs with the
        device once (and, where a process group of more than one rank is up, all-reduces the
        statistics: every rank decides the same). Returns this step's moves.
        """
        if not self._handles:
            raise RuntimeError("this guard is closed: its probes are gone, so a step would see nothing")
        self.steps += 1
        readings = self._read()
        if all(row[KIND] == 0 for row in readings):
            raise RuntimeError(
                "the guard saw no call of any layer it watches since the last step. Was the model compiled and "
                "run before the guard was made? torch.compile does not guard on module hooks by default, so its "
                "graph goes on without the guard's probes: make the guard before the first compiled call, or "
                "call torch.compiler.reset() after making it"
            )
        scale_used, self.scale = self.scale, float(self.scaler.get_scale()) if self.scaler is not None else 1.0
        signals = self._signals(readings, scale_used)
        moves = []
        for index, name in enumerate(self._names):
            found = signals.get(index)
            if found is None:
                self.strikes[name] = 0
            else:
                self.strikes[name] += 1
                if self.strikes[name] >= self.thresholds.patience:
                    move = self._move(name, *found)
                    if move is not None:
                        moves.append(move)
            for k, column in enumerate((IN, GRAD_OUT)):
                value = readings[index][column]
                if math.isfinite(value) and name not in {m.layer for m in moves}:
                    self.peaks[name][k] = max(self.peaks[name][k], value)
        return moves

    def _read(self) -> list[list[float]]:
        """Per layer, the columns named at the top of this module: the step's amaxes and origin flags, the
        weight gradient non-finite (1/0), fp8 saturated and flushed fractions (the largest over casts);
        inf for non-finite."""
        zero, zeros = self._fwd.new_zeros(()), self._fwd.new_zeros(2)
        grads = [probes.local_grad(getattr(m, "weight", None)) for m in self.layers.values()]
        bad_weight = [(~torch.isfinite(g).all()).float() if g is not None else zero for g in grads]
        fp8 = []
        for module in self.layers.values():
            scaling = fp8_conversion.scaling_of(module)
            fp8.append(scaling.cast_fractions() if scaling is not None and scaling.recording else zeros)
        table = torch.cat(
            [
                torch.maximum(self._fwd, self._bwd),
                torch.stack(bad_weight)[:, None],
                torch.stack(fp8),
                self._kind[:, None],
            ],
            dim=1,
        )
        # a NaN is as non-finite as an inf (and all-reduces as one)
        table = torch.nan_to_num(table, nan=math.inf, posinf=math.inf)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self._fwd.zero_()
        self._bwd.zero_()
        self._kind.zero_()
        for module in self.layers.values():
            scaling = fp8_conversion.scaling_of(module)
            if scaling is not None:
                scaling.clear_stats()
        rows: list[list[float]] = table.tolist()  # the sync
        for index, row in enumerate(rows):
            if row[KIND] > 0:
                self._seen[index] = KINDS[int(row[KIND]) - 1]
        return rows

    def _signals(self, rows: list[list[float]], scale_used: float) -> dict[int, tuple[str, str]]:
        """Layer index -> (signal, detail) for the layers with one this step (the first signal found)."""
        th = self.thresholds
        found: dict[int, tuple[str, str]] = {}
        for index, name in enumerate(self._names):
            row, seen = rows[index], self._seen.get(index)
            if row[FWD_ORIGIN] > 0:
                found[index] = ("nonfinite_forward", "output inf/NaN from a finite input")
            # (a weight gradient is the layer's doing only where its output gradients and inputs were finite)
            elif scale_used <= th.backward_scale and (
                row[BWD_ORIGIN] > 0 or (row[BAD_WEIGHT_GRAD] > 0 and math.isfinite(row[GRAD_OUT] + row[IN]))
            ):
                which = "input" if row[BWD_ORIGIN] > 0 else "weight"
                found[index] = (
                    "nonfinite_backward",
                    f"{which} gradient inf/NaN from a finite output gradient at loss scale {scale_used:g}",
                )
            elif seen == LayerPrecision.FP16 and math.isfinite(row[OUT]) and row[OUT] > th.fp16_margin * FP16_MAX:
                found[index] = ("fp16_overflow", f"output amax {row[OUT]:.4g} > {th.fp16_margin:g} x {FP16_MAX:g}")
            elif seen is not None and LayerPrecision.from_name(seen).fp8_recipe is not None:
                signal = self._fp8_signal(name, row)
                if signal is not None:
                    found[index] = signal
        return found

    def _fp8_signal(self, name: str, row: list[float]) -> tuple[str, str] | None:
        th = self.thresholds
        saturated, flushed = row[SATURATED], row[FLUSHED]
        if saturated > th.saturated:
            return "saturated", f"{saturated:.2%} of a cast's values clamped at the fp8 max (> {th.saturated:.2%})"
        if flushed > th.flushed:
            return "flushed", f"{flushed:.2%} of a cast's non-zero values flushed to zero (> {th.flushed:.2%})"
        if self.steps > th.warmup:
            for k, (column, what) in enumerate(((IN, "input"), (GRAD_OUT, "output gradient"))):
                peak, value = self.peaks[name][k], row[column]
                if peak > 0 and math.isfinite(value) and value > th.amax_jump * peak:
                    return "amax_jump", f"{what} amax {value:.4g} = {value / peak:.3g} x its peak {peak:.4g}"
        return None

    def _move(self, name: str, signal: str, detail: str) -> LayerMove | None:
        index = self._names.index(name)
        current = layer_precision(self.model, name) or self._seen.get(index)
        target = self.thresholds.ladder.get(current) if current is not None else None
        if current is None or target is None:
            return None  # at the top of its ladder: nothing to move to
        set_layer_precision(self.model, name, target)
        self._set_recording(True)
        move = LayerMove(self.steps, name, current, target, signal, f"{detail}; {self.strikes[name]} steps in a row")
        self.moves.append(move)
        self.strikes[name] = 0
        self.peaks[name] = [0.0, 0.0]
        self._seen.pop(index, None)
        logger.warning("%s", move)
        if self.callback is not None:
            self.callback(move)
        return move

    # ----- state ----------------------------------------------------------------------

    def precisions(self) -> dict[str, str | None]:
        """Each watched layer's precision: the one it was moved to, else what it computed in last (``None``
        before its first forward)."""
        return {n: layer_precision(self.model, n) or self._seen.get(i) for i, n in enumerate(self._names)}

    def state_dict(self) -> dict[str, Any]:
        """The guard's decisions and counters (host values): save it with the model's checkpoint."""
        return {
            "steps": self.steps,
            "scale": self.scale,
            "moves": [dataclasses.asdict(m) for m in self.moves],
            "strikes": dict(self.strikes),
            "peaks": {n: list(p) for n, p in self.peaks.items()},
            "thresholds": self.thresholds.to_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters and replay the moves on this guard's model (each layer to its last
        move's precision); load it before or after the model's state dict, either order.

        Raises:
            ValueError: a state of a guard that watched other layers.
        """
        unknown = sorted(set(state["strikes"]) - set(self.layers))
        if unknown:
            raise ValueError(f"this guard state watches layers this guard does not: {unknown[:5]}")
        self.steps, self.scale = int(state["steps"]), float(state["scale"])
        self.moves = [LayerMove(**m) for m in state["moves"]]
        self.strikes = {n: int(state["strikes"].get(n, 0)) for n in self.layers}
        self.peaks = {n: [float(v) for v in state["peaks"].get(n, (0.0, 0.0))] for n in self.layers}
        for move in self.moves:
            set_layer_precision(self.model, move.layer, move.to)
        self._set_recording(True)

    def close(self) -> None:
        """Remove the probes and stop recording fp8 statistics; the layers keep their precisions."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._set_recording(False)
