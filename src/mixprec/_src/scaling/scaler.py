"""GradScaler: dynamic loss scaling, a drop-in for ``torch.amp.GradScaler``.

With torch's settings it computes torch's numbers: the same scale after every
``update()`` and bitwise-identical parameters. It adds a floor and a ceiling
for the scale, hysteresis, a fail-fast check for runs that only overflow,
per-optimizer skip reporting, counters, and MegEngine's automatic
(``scaler.backward``) and manual (``scale_factor``/``unscale``/``update``) styles.

Algorithm (per iteration)::

    loss * scale -> backward                      # scale(loss).backward()
    for each optimizer:
        grads *= 1/scale (reciprocal in fp64)     # unscale_, fused per device and dtype
        found_inf = any(grad is inf or NaN)       # same fused kernel
        if not found_inf: optimizer.step()        # step
    if any found_inf:                             # update
        tolerated -= 1
        if tolerated <= 0: scale = max(scale * backoff_factor, min_scale)
        good_steps = 0
    else:
        good_steps += 1
        if good_steps == growth_interval:
            scale = min(scale * growth_factor, max_scale); good_steps = 0; tolerated = hysteresis

Host syncs: ``step`` syncs once per device to read ``found_inf`` (as torch's does),
except for optimizers that take ``grad_scale``/``found_inf`` themselves (torch's
fused Adam, AdamW, SGD), where it does not sync. ``scale``, ``unscale_`` and
``update`` never sync. ``get_scale``, ``state_dict``, ``stats``, ``unscale``
(MegEngine style) and ``skipped`` on a fused optimizer do.

The pieces live apart: the rule and its state in ``loss_scale``, unscaling and the
cross-rank agreement in ``unscaling``, events and counters in ``events``, the fail-fast
check in ``fail_fast``, argument checks in ``settings``, one iteration's bookkeeping in
``iteration``, the state and torch's private members in ``torch_members``. This module
keeps torch's public API and MegEngine's.

Long because it is one class: torch.amp.GradScaler's public methods and MegEngine's, each with the
docstring and argument checks its users read; splitting a class's public methods across modules would
hide the API it mirrors.
"""

from __future__ import annotations

import inspect
import warnings
from collections import abc
from collections.abc import Iterable
from typing import Any, overload

import torch
from torch.amp.grad_scaler import OptState

from mixprec._src import _compat
from mixprec._src.scaling import fail_fast, unscaling
from mixprec._src.scaling import settings as scaler_settings
from mixprec._src.scaling.events import EventLog, ScalerEvent, ScalerStats, logger
from mixprec._src.scaling.iteration import Iteration
from mixprec._src.scaling.loss_scale import DeviceLossScale, LossScaleRule, LossScaleState
from mixprec._src.scaling.settings import checked
from mixprec._src.scaling.torch_members import ScalerState

__all__ = ["GradScaler", "ScalerEvent", "ScalerStats"]


def __getattr__(name: str) -> Any:
    return _compat.forward("scaling.scaler", name)  # names older pickles hold


def _refuse_in_backward(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer prepared with ``step_in_backward=True`` steps during backward, on gradients no scaler checked."""
    if optimizer.__dict__.get("_mixprec_step_in_backward") is not None:  # prepare's step_in_backward.KEY
        raise RuntimeError(
            "this optimizer was prepared with step_in_backward=True: its parameters were stepped during "
            "backward, before an enabled GradScaler could check every gradient for inf/NaN. Train "
            "without loss scaling (bf16 needs none: GradScaler(enabled=False)), or prepare with "
            "step_in_backward=False"
        )


class GradScaler(ScalerState):
    """Dynamic loss scaling; torch.amp.GradScaler's arguments and methods, plus more.

    The class is long because it is torch's whole API surface (every public method, and the
    private ones torch's fused optimizers and tests call) plus MegEngine's; each method checks
    its arguments and the iteration's stage, then delegates to the modules named above.

    Args:
        device: ``"cuda"`` or ``"cpu"``; with ``"cuda"`` and no CUDA it warns and disables
            itself, as torch's does.
        init_scale: the first scale (positive and finite: an infinite scale overflows every step).
        growth_factor: multiplies the scale after ``growth_interval`` good iterations (> 1).
        backoff_factor: multiplies the scale after an overflowing iteration (< 1).
        growth_interval: good iterations in a row before the scale grows.
        enabled: ``False`` makes every method a pass-through.
        min_scale: the scale never backs off below this (default: no floor, as torch).
        max_scale: the scale never grows above this (default: no ceiling, as torch).
        hysteresis: overflowing iterations tolerated before backing off (DeepSpeed's and
            Megatron-LM's; 1 = back off at once, as torch).
        fail_after: raise when this many iterations in a row overflowed while the scale is at
            its floor (``min_scale``, or 1.0) or not finite (set so by ``update(new_scale)``),
            instead of skipping every step; ``None`` never raises.
        history: how many scale changes :meth:`stats` remembers.
        process_group: a ``torch.distributed`` group whose ranks hold different gradients (FSDP2
            shards, or any sharding): the inf/NaN flags are summed across it, so every rank skips or
            steps together, as torch's ShardedGradScaler does. Not needed under DDP, whose gradients
            are already all-reduced. Adds one all-reduce per optimizer and device to ``unscale_``.
        on_event: called with a :class:`ScalerEvent` on every skip, backoff and growth that the host
            sees without an extra sync (every one, unless the optimizer is a fused one); the same events
            are logged on the ``mixprec.scaler`` logger (skip and backoff at INFO, growth at DEBUG).

    Raises:
        TypeError: an argument that is not a number (or None where allowed); the message says what is valid.
        ValueError: a factor, interval, bound or count that cannot work (NaN, infinite, out of range);
            the message says what was given and what is valid.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        fail_after: int | None = 50,
        history: int = 64,
        on_event: Any = None,
        process_group: Any = None,
    ) -> None:
        self._device = device
        self._enabled = enabled
        if enabled and device == "cuda" and not torch.cuda.is_available():
            warnings.warn("mixprec.GradScaler: device 'cuda' but CUDA is not available; disabling", stacklevel=2)
            self._enabled = False
        # Checked even when disabled: a typo should not wait for the GPU run to surface.
        self._rule = LossScaleRule(
            growth_factor=checked("growth_factor", growth_factor),
            backoff_factor=checked("backoff_factor", backoff_factor),
            growth_interval=checked("growth_interval", growth_interval),
            hysteresis=checked("hysteresis", hysteresis),
            min_scale=checked("min_scale", min_scale),
            max_scale=checked("max_scale", max_scale),
        )
        scaler_settings.check_bounds(self._rule.min_scale, self._rule.max_scale, ("min_scale", "max_scale"))
        self._fail_after: int | None = checked("fail_after", fail_after)
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be a callable taking a ScalerEvent, or None; got {on_event!r}")
        # The state as numbers until the first scale() puts it on the loss's device.
        self._initial = LossScaleState(checked("scale", init_scale, "init_scale"), 0, self._rule.hysteresis)
        self._device_state: DeviceLossScale | None = None
        self._iteration = Iteration()
        self._last_skipped: dict[int, bool | torch.Tensor] = {}
        self._updates = 0
        self._events = EventLog(on_event, self._rule.hysteresis, checked("history", history))
        self._process_group = process_group

    # ----- torch.amp.GradScaler's API ----------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> Any:
        """Multiply a tensor, or nested iterables of tensors, by the scale. Does not sync.

        Also starts a new iteration after one abandoned by an exception in ``optimizer.step()``.

        Raises:
            TypeError: something that is neither a tensor nor an iterable of them.
        """
        if not self._enabled:
            return outputs
        if self._iteration.failed:
            self._iteration = Iteration()
        if isinstance(outputs, torch.Tensor):
            scale = self._lazy_init(outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        copies: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                scale = self._lazy_init(value.device)
                if value.device not in copies:
                    copies[value.device] = scale.to(device=value.device, non_blocking=True, copy=True)
                return value * copies[value.device]
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise TypeError(f"scale() takes a tensor or an iterable of tensors, got {type(value).__name__}")

        return apply(outputs)

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly, as torch.amp's are
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place, and check them for inf/NaN.

        Optional: ``step`` unscales if this was not called. Call it once per optimizer per
        iteration, after all gradients are accumulated (e.g. before clipping). Does not sync.

        Raises:
            RuntimeError: called twice in an iteration, after ``step``, or before ``scale``.
        """
        if not self._enabled:
            return
        _refuse_in_backward(optimizer)
        scale = self._require_scale("unscale_")
        state = self._iteration.per_optimizer[id(optimizer)]
        self._check_not_failed(optimizer, "unscale_")
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "call it once per optimizer per iteration, after all gradients are accumulated"
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step() for this optimizer; call scaler.unscale_(optimizer) "
                "before scaler.step(optimizer), then scaler.update()"
            )
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        # allow_fp16: low-precision gradients are unscaled in fp32 math (torch's refuses fp16 ones).
        found = self._unscale_grads_(optimizer, unscaling.inverse(scale), found_inf, True)
        state["found_inf_per_device"] = unscaling.agree(found, self._process_group)
        state["stage"] = OptState.UNSCALED

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly, as torch.amp's are
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done) and run ``optimizer.step(*args, **kwargs)`` unless gradients hold inf/NaN.

        Returns what ``optimizer.step`` returns, or ``None`` when the step is skipped.
        Syncs once per device to read the inf/NaN flag, except for optimizers that take
        ``grad_scale``/``found_inf`` themselves (fused Adam, AdamW, SGD): those do not sync.
        An optimizer whose ``step`` takes a ``grad_scaler`` argument gets this scaler (with
        torch's FutureWarning) and does its own unscaling and checks, as with torch's scaler.

        If ``optimizer.step()`` raises, the exception propagates and the iteration is abandoned:
        the scale does not move, ``update()`` is optional (it only clears the iteration), and the
        next ``scale()`` starts a fresh iteration.

        Raises:
            RuntimeError: ``step`` twice in an iteration, a ``closure`` argument, no ``scale`` first,
                or a retry after ``optimizer.step()`` raised, without a new ``scale()``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "closure use is not supported with an enabled GradScaler; compute the loss before step()"
            )
        _refuse_in_backward(optimizer)
        scale = self._require_scale("step")
        state = self._iteration.per_optimizer[id(optimizer)]
        self._check_not_failed(optimizer, "step")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called for this optimizer since the last update(); "
                "call scaler.update() once at the end of each iteration"
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, scale, *args, **kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise RuntimeError("no gradients were found for this optimizer; did backward() reach its parameters?")
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # run eagerly, as torch.amp's are
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off after an overflowing iteration, grow it after a run of good ones.

        Call once per iteration, after ``step`` for every optimizer used. ``new_scale`` sets
        the scale instead. Does not sync (except every 100 iterations when a fused optimizer
        hides overflow counts from the host, for the fail-fast check). After an iteration
        abandoned by an exception in ``optimizer.step()`` it is optional: it clears the
        iteration and leaves the scale where it was (``new_scale`` still sets it).

        Raises:
            RuntimeError: nothing was stepped or unscaled since the last update; or ``fail_after``
                iterations in a row overflowed with the scale at its floor or not finite.
            ValueError: a ``new_scale`` number that is not positive and finite, or a tensor that
                is not a 1-element, grad-free tensor.
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        device_state = self._device_state
        assert device_state is not None  # made with the scale
        iteration = self._iteration
        if iteration.failed:
            if new_scale is not None:
                _set_scale(scale, new_scale)
            self._iteration = Iteration()
            return
        found_infs = iteration.found_infs(scale.device)
        host_flags = iteration.host_flags()
        if new_scale is not None:
            _set_scale(scale, new_scale)
            if found_infs:  # a scale set by hand still counts skipped steps, for fail_after
                device_state.count_skips(sum(found_infs[1:], found_infs[0]))
            self._iteration = Iteration()
            if found_infs:
                self._maybe_fail_fast(host_flags)
            return
        if not found_infs:
            raise RuntimeError(
                "update() found no inf/NaN checks: call scaler.step(optimizer) (or unscale_/unscale) "
                "for at least one optimizer before update()"
            )
        found = found_infs[0]
        for other in found_infs[1:]:
            found = found + other
        device_state.count_skips(found)
        device_state.update(self._rule, found)
        self._updates += 1
        self._events.record(self._updates, scale)
        self._iteration = Iteration()
        if all(flag is not None for flag in host_flags):
            self._events.updated(self._rule, any(host_flags), self._updates, self.get_scale)
        self._maybe_fail_fast(host_flags)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs."""
        if not self._enabled:
            return 1.0
        return self._initial.scale if self._device_state is None else float(self._device_state.scale.item())

    def get_growth_factor(self) -> float:
        return self._rule.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Raises ValueError or TypeError for a value that cannot work, as the constructor does."""
        self._set_rule(growth_factor=checked("growth_factor", new_factor, "new_factor"))

    def get_backoff_factor(self) -> float:
        return self._rule.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Raises ValueError or TypeError for a value that cannot work, as the constructor does."""
        self._set_rule(backoff_factor=checked("backoff_factor", new_factor, "new_factor"))

    def get_growth_interval(self) -> int:
        return self._rule.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Raises ValueError or TypeError for a value that cannot work, as the constructor does."""
        self._set_rule(growth_interval=checked("growth_interval", new_interval, "new_interval"))

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """Every field needed to resume; torch's keys first, so torch.amp.GradScaler loads it. Syncs.

        Empty when disabled, as torch's. Call it after ``update()``.
        """
        if not self._enabled:
            return {}
        return scaler_settings.to_state_dict(self._rule, self._fail_after, self._updates, self._current())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from torch.amp.GradScaler (a no-op when disabled).

        Every entry is checked before anything is loaded; a bad one leaves the scaler unchanged.
        Settings a torch state dict lacks (``min_scale``, ``hysteresis``, ...) keep this scaler's.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler).
            ValueError: missing torch keys, keys neither class writes, or a value out of range; the
                message names the key and says what it should hold.
            TypeError: not a dict, or a value that is not a number; the message names the key.
        """
        if not self._enabled:
            return
        loaded = scaler_settings.from_state_dict(state_dict, self._rule, self._fail_after)
        self._rule, self._fail_after, self._updates, self._initial = loaded
        if self._device_state is not None:
            self._device_state.load(self._initial)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._iteration.in_progress() and not self._iteration.failed:
            raise RuntimeError("pickle a GradScaler at the start of an iteration or after update(), not in between")
        state = self.__dict__.copy()
        if self._enabled:
            state["_initial"] = self._current()
            state["_device_state"] = None
        del state["_iteration"]  # a fresh one after loading
        state["_last_skipped"] = {}
        state["_process_group"] = None  # groups do not pickle; pass it again after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "_iteration": Iteration()})

    # ----- beyond torch --------------------------------------------------------------------

    def skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last ``step(optimizer)`` was skipped for inf/NaN gradients.

        Free after an ordinary step (it synced already); syncs after a fused optimizer's.

        Raises:
            RuntimeError: ``step`` was never called for this optimizer.
        """
        if not self._enabled:
            return False
        if id(optimizer) not in self._last_skipped:
            raise RuntimeError("skipped(): scaler.step() was never called for this optimizer")
        flag = self._last_skipped[id(optimizer)]
        return bool(flag.item()) if isinstance(flag, torch.Tensor) else flag

    def step_scheduler(self, scheduler: Any, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Step an LR scheduler unless its optimizer's last step was skipped.

        Keeps the schedule in line with the updates actually applied, and avoids torch's
        "lr_scheduler.step() before optimizer.step()" warning when the first step is skipped.
        Returns whether the scheduler stepped.
        """
        optimizer = optimizer if optimizer is not None else scheduler.optimizer
        if self.skipped(optimizer):  # type: ignore[arg-type]
            return False
        scheduler.step()
        return True

    def stats(self) -> ScalerStats:
        """Counters for logging: scale, updates, skipped iterations, recent scale changes. Syncs."""
        skipped, consecutive = self._skip_counts() if self._enabled else (0, 0)
        return ScalerStats(self.get_scale(), self._updates, skipped, consecutive, self._events.changes())

    @property
    def scale_factor(self) -> float:
        """The current scale (MegEngine's name); multiply the loss's gradient by it. Syncs."""
        return self.get_scale()

    def unscale(self, params: torch.optim.Optimizer | Iterable[torch.Tensor]) -> bool:
        """MegEngine's manual style: unscale gradients in place and record the inf/NaN check.

        ``params`` is an optimizer, parameters (their ``.grad`` is unscaled) or gradient
        tensors. When a gradient holds inf/NaN, every parameter's ``.grad`` is set to
        ``None``, so a following ``optimizer.step()`` changes nothing; ``update()`` then backs
        the scale off. Returns whether inf/NaN was found. Syncs once.
        """
        if not self._enabled:
            return False
        if self._iteration.failed:
            self._iteration = Iteration()
        sources = unscaling.manual_sources(params)
        # The manual style may multiply the loss's gradient by scale_factor without scale():
        # start the scale on the gradients' device then.
        scale = self._scale if self._scale is not None else self._lazy_init(unscaling.first_device(sources))
        found, overflow, dropped = unscaling.unscale_manually(sources, scale, self._process_group)
        self._iteration.manual_found.append(found)
        self._iteration.manual_flags.append(overflow)
        if overflow:
            logger.info("unscale(): gradients hold inf/NaN; dropped %d gradients", dropped)
        return overflow

    def backward(
        self,
        loss: torch.Tensor,
        params: torch.optim.Optimizer | Iterable[torch.Tensor] | None = None,
        *,
        update: bool = True,
        retain_graph: bool | None = None,
    ) -> bool:
        """MegEngine's automatic style: scale, backward, then unscale and update.

        With ``params`` (an optimizer or parameters) the gradients are unscaled and checked
        (dropped on overflow, see :meth:`unscale`) and, with ``update``, the scale is
        updated; then call ``optimizer.step()`` as usual. Returns whether inf/NaN was found.
        Syncs once when ``params`` is given.
        """
        if not self._enabled:
            loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
            return False
        self.scale(loss).backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        if params is None:
            return False
        overflow = self.unscale(params)
        if update:
            self.update()
        return overflow

    def add_listener(self, callback: Any) -> None:
        """Call ``callback(ScalerEvent)`` on skips, backoffs and growths (see ``on_event``)."""
        self._events.listeners.append(callback)

    def remove_listener(self, callback: Any) -> None:
        """Stop calling ``callback``; a callback not listening is ignored."""
        if callback in self._events.listeners:
            self._events.listeners.remove(callback)

    # ----- internals -------------------------------------------------------------------

    def _set_rule(self, **changes: Any) -> None:
        self._rule = LossScaleRule(**{**vars(self._rule), **changes})

    def _maybe_fail_fast(self, host_flags: list[bool | None]) -> None:
        if self._fail_after is not None and fail_fast.due(host_flags, self._updates):
            _, consecutive = self._skip_counts()
            fail_fast.check(consecutive, self._fail_after, self._rule.min_scale, self.get_scale)

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], scale: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # torch's older contract, still honoured by torch's scaler: the optimizer gets the scaler and
            # unscales and checks by itself (through unscale_, _check_inf_per_device, _found_inf_per_device).
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer "
                "(torch.amp.GradScaler's deprecation, kept for compatibility): read `optimizer.grad_scale` "
                "and `optimizer.found_inf` instead of taking a `grad_scaler` argument.",
                FutureWarning,
                stacklevel=3,
            )
            result = self._run_optimizer_step(optimizer, *args, **{**kwargs, "grad_scaler": self})
            state["stage"] = OptState.STEPPED
            found = unscaling.summed(state["found_inf_per_device"], scale.device)
            if found is not None:
                self._last_skipped[id(optimizer)] = found > 0
            return result
        # The optimizer unscales and skips by itself, reading grad_scale and found_inf: no sync.
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        found = unscaling.summed(state["found_inf_per_device"], scale.device)
        found_tensor = found if found is not None else torch.zeros_like(scale)
        previous = getattr(optimizer, "grad_scale", None)
        # After unscale_ the gradients are already unscaled: pass only a user's own grad_scale.
        if state["stage"] is OptState.UNSCALED:
            optimizer.grad_scale = previous  # type: ignore[attr-defined]
        else:
            optimizer.grad_scale = scale * previous if previous is not None else scale * 1  # type: ignore[attr-defined]
        optimizer.found_inf = found_tensor  # type: ignore[attr-defined]
        try:
            result = self._run_optimizer_step(optimizer, *args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state["stage"] = OptState.STEPPED
        self._last_skipped[id(optimizer)] = found_tensor > 0
        return result


def _set_scale(scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
    """Set the scale by hand (``update(new_scale)``).

    Raises:
        ValueError: a number that is not positive and finite, or a tensor with more than one
            element or that requires grad.
    """
    if not isinstance(new_scale, torch.Tensor):
        # A tensor's value is not checked (that would sync): fail_after catches a non-finite one.
        scale.fill_(checked("scale", new_scale, "new_scale"))
        return
    if new_scale.numel() != 1 or new_scale.requires_grad:
        raise ValueError("new_scale must be a float or a 1-element tensor that does not require grad")
    scale.copy_(new_scale.reshape(()))
