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
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import logging
import math
import numbers
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any, overload

import torch
from torch.amp.grad_scaler import OptState

from mixprec._src.errors import LossScaleCollapseError
from mixprec._src.loss_scale import LossScaleRule

logger = logging.getLogger("mixprec.scaler")

# With no min_scale, a scale at or below this counts as "at the floor" for fail-fast.
_DEFAULT_FLOOR = 1.0
# Fused optimizers report found_inf only on the device: the fail-fast check reads it this often.
_FUSED_CHECK_INTERVAL = 100


def _refresh_per_optimizer_state() -> dict[str, Any]:
    """One optimizer's state in an iteration, in torch's layout and with torch's stage enum
    (READY / UNSCALED / STEPPED), so code written against torch.amp.GradScaler reads it unchanged."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


@dataclasses.dataclass(frozen=True)
class ScalerEvent:
    """Something the scaler did: ``kind`` is ``"skip"`` (an optimizer step skipped for inf/NaN),
    ``"backoff"`` (the scale shrank) or ``"growth"`` (it grew); ``update`` counts updates so far."""

    kind: str
    update: int
    scale: float | None
    optimizer: str | None = None


@dataclasses.dataclass(frozen=True)
class ScalerStats:
    """Counters for logging; reading them syncs with the device.

    Attributes:
        scale: the current scale.
        updates: ``update()`` calls so far.
        skipped_iterations: updates whose iteration had inf/NaN gradients.
        consecutive_skipped: how many of the latest updates in a row had them.
        history: the latest scale changes as ``(update index, old scale, new scale)``.
    """

    scale: float
    updates: int
    skipped_iterations: int
    consecutive_skipped: int
    history: tuple[tuple[int, float, float], ...]


class GradScaler:
    """Dynamic loss scaling; torch.amp.GradScaler's arguments and methods, plus more.

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
        self._init_scale: float = _checked("scale", init_scale, "init_scale")
        self._growth_factor: float = _checked("growth_factor", growth_factor)
        self._backoff_factor: float = _checked("backoff_factor", backoff_factor)
        self._growth_interval: int = _checked("growth_interval", growth_interval)
        self._min_scale: float | None = _checked("min_scale", min_scale)
        self._max_scale: float | None = _checked("max_scale", max_scale)
        _check_bounds(self._min_scale, self._max_scale, ("min_scale", "max_scale"))
        self._hysteresis: int = _checked("hysteresis", hysteresis)
        self._fail_after: int | None = _checked("fail_after", fail_after)
        history = _checked("history", history)
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be a callable taking a ScalerEvent, or None; got {on_event!r}")
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = self._hysteresis
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._skip_count: torch.Tensor | None = None  # (skipped iterations, consecutive skipped)
        self._init_skip_count = (0, 0)
        # Torch's name and layout: code written against torch.amp.GradScaler reaches into it.
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        self._host_skipped: dict[int, bool] = {}  # per optimizer, read on the host by a syncing step()
        self._manual_found: list[torch.Tensor] = []  # from unscale(), MegEngine style
        self._manual_flags: list[bool | None] = []
        self._last_skipped: dict[int, bool | torch.Tensor] = {}
        self._failed: set[int] = set()  # optimizers whose step() raised: the iteration is abandoned
        self._updates = 0
        self._history: collections.deque[tuple[int, torch.Tensor]] = collections.deque(maxlen=max(2, history + 1))
        self._listeners: list[Any] = [on_event] if on_event is not None else []
        self._process_group = process_group
        self._host_good = 0  # good iterations in a row, as far as the host has seen them
        self._host_tolerated = self._hysteresis

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
        if self._failed:
            self._reset_iteration()
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
        scale = self._require_scale("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
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
        found = self._unscale_grads_(optimizer, _inverse(scale), found_inf, True)
        state["found_inf_per_device"] = self._agree(found)
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
        scale = self._require_scale("step")
        state = self._per_optimizer_states[id(optimizer)]
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
        if self._failed:
            if new_scale is not None:
                self._set_scale(scale, new_scale)
            self._reset_iteration()
            return
        found_infs = [
            found.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found in state["found_inf_per_device"].values()
        ] + [found.to(device=scale.device, non_blocking=True) for found in self._manual_found]
        # Overflow flags the host already read (ordinary step(), unscale()): fused optimizers give None.
        host_flags = [
            self._host_skipped.get(key) for key, state in self._per_optimizer_states.items()
            if state["found_inf_per_device"]
        ] + self._manual_flags  # fmt: skip
        if new_scale is not None:
            self._set_scale(scale, new_scale)
            if found_infs:  # a scale set by hand still counts skipped steps, for fail_after
                self._count_skips(sum(found_infs[1:], found_infs[0]))
            self._reset_iteration()
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
        self._count_skips(found)
        self._apply_update(scale, found)
        self._updates += 1
        self._history.append((self._updates, scale.clone()))
        self._reset_iteration()
        if all(flag is not None for flag in host_flags):
            self._host_events(any(host_flags))
        self._maybe_fail_fast(host_flags)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Raises ValueError or TypeError for a value that cannot work, as the constructor does."""
        self._growth_factor = _checked("growth_factor", new_factor, "new_factor")

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Raises ValueError or TypeError for a value that cannot work, as the constructor does."""
        self._backoff_factor = _checked("backoff_factor", new_factor, "new_factor")

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Raises ValueError or TypeError for a value that cannot work, as the constructor does."""
        self._growth_interval = _checked("growth_interval", new_interval, "new_interval")

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """Every field needed to resume; torch's keys first, so torch.amp.GradScaler loads it. Syncs.

        Empty when disabled, as torch's. Call it after ``update()``.
        """
        if not self._enabled:
            return {}
        skipped, consecutive = self._skip_counts()
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": _item(self._hysteresis_tracker, self._init_hysteresis_tracker),
            "fail_after": self._fail_after,
            "updates": self._updates,
            "skipped_iterations": skipped,
            "consecutive_skipped": consecutive,
        }

    _TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from torch.amp.GradScaler (a no-op when disabled).

        Every entry is checked before anything is loaded; a bad one leaves the scaler unchanged.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler).
            ValueError: missing torch keys, keys neither class writes, or a value out of range; the
                message names the key and says what it should hold.
            TypeError: not a dict, or a value that is not a number; the message names the key.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"load_state_dict takes the dict from state_dict(), got {type(state_dict).__name__}")
        if not state_dict:
            raise RuntimeError(
                "the state dict is empty, probably saved from a disabled GradScaler; nothing to resume from"
            )
        missing = [k for k in self._TORCH_KEYS if k not in state_dict]
        unknown = sorted(map(str, set(state_dict) - set(self._TORCH_KEYS) - set(self._defaults_for_extras())))
        if missing or unknown:
            raise ValueError(
                f"not a GradScaler state dict: missing {missing}, unknown {unknown}; "
                f"expected {list(self._TORCH_KEYS)} and optionally {list(self._defaults_for_extras())}"
            )
        values = {**self._defaults_for_extras(), **state_dict}
        if "_hysteresis_tracker" not in state_dict:
            values["_hysteresis_tracker"] = values["hysteresis"]
        checked = {key: _checked(key, value, f"state_dict[{key!r}]") for key, value in values.items()}
        _check_bounds(
            checked["min_scale"], checked["max_scale"], ("state_dict['min_scale']", "state_dict['max_scale']")
        )
        self._init_scale = checked["scale"]
        self._growth_factor = checked["growth_factor"]
        self._backoff_factor = checked["backoff_factor"]
        self._growth_interval = checked["growth_interval"]
        self._init_growth_tracker = checked["_growth_tracker"]
        self._min_scale, self._max_scale = checked["min_scale"], checked["max_scale"]
        self._hysteresis = checked["hysteresis"]
        self._init_hysteresis_tracker = checked["_hysteresis_tracker"]
        self._fail_after = checked["fail_after"]
        self._updates = checked["updates"]
        self._init_skip_count = (checked["skipped_iterations"], checked["consecutive_skipped"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)  # type: ignore[union-attr]
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)  # type: ignore[union-attr]
            self._skip_count.copy_(torch.tensor(self._init_skip_count))  # type: ignore[union-attr]

    def _defaults_for_extras(self) -> dict[str, Any]:
        # What a torch.amp.GradScaler state dict lacks: keep this scaler's own settings.
        return {
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._hysteresis,
            "fail_after": self._fail_after,
            "updates": 0,
            "skipped_iterations": 0,
            "consecutive_skipped": 0,
        }

    def __getstate__(self) -> dict[str, Any]:
        in_iteration = any(s["found_inf_per_device"] for s in self._per_optimizer_states.values()) or self._manual_found
        if self._enabled and in_iteration and not self._failed:
            raise RuntimeError("pickle a GradScaler at the start of an iteration or after update(), not in between")
        state = self.__dict__.copy()
        if self._enabled:
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = _item(self._hysteresis_tracker, self._init_hysteresis_tracker)
            state["_init_skip_count"] = self._skip_counts()
            for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skip_count"):
                state[name] = None
        state["_per_optimizer_states"] = defaultdict(_refresh_per_optimizer_state)
        state["_host_skipped"] = {}
        state["_manual_found"] = []
        state["_manual_flags"] = []
        state["_failed"] = set()
        state["_last_skipped"] = {}
        state["_history"] = collections.deque(maxlen=self._history.maxlen)
        state["_listeners"] = []
        state["_process_group"] = None  # groups do not pickle; pass it again after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

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
        points = [(i, float(s.item())) for i, s in self._history]
        changes = tuple((i, a, b) for (_, a), (i, b) in itertools.pairwise(points) if a != b)
        return ScalerStats(self.get_scale(), self._updates, skipped, consecutive, changes)

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
        if self._failed:
            self._reset_iteration()
        sources = _grads_source(params)
        # The manual style may multiply the loss's gradient by scale_factor without scale():
        # start the scale on the gradients' device then.
        scale = self._scale if self._scale is not None else self._lazy_init(_first_device(sources))
        owners: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for tensor in sources:
            if tensor.requires_grad and tensor.is_leaf:
                if tensor.grad is not None:
                    owners.append(tensor)
                    grads.append(tensor.grad)
            else:
                grads.append(tensor)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        found_per_device = self._agree(_unscale_and_check(grads, _inverse(scale), found_inf))
        found = sum(found_per_device.values(), torch.zeros((), device=scale.device))
        self._manual_found.append(found)
        overflow = bool(found.item())
        self._manual_flags.append(overflow)
        if overflow:
            for owner in owners:
                owner.grad = None
            logger.info("unscale(): gradients hold inf/NaN; dropped %d gradients", len(owners))
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
        self._listeners.append(callback)

    def remove_listener(self, callback: Any) -> None:
        """Stop calling ``callback``; a callback not listening is ignored."""
        if callback in self._listeners:
            self._listeners.remove(callback)

    # ----- internals -------------------------------------------------------------------

    def _agree(self, found_per_device: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """Sum the inf/NaN flags over the process group (no host sync: the all-reduce is queued)."""
        if self._process_group is not None:
            import torch.distributed as dist

            for found in found_per_device.values():
                dist.all_reduce(found, op=dist.ReduceOp.SUM, group=self._process_group)
        return found_per_device

    def _emit(self, kind: str, scale: float | None, optimizer: str | None = None) -> None:
        event = ScalerEvent(kind, self._updates, scale, optimizer)
        for listener in list(self._listeners):
            listener(event)

    def _host_events(self, overflow: bool) -> None:
        # The update rule again, on the host, from flags it already read: no extra sync, except
        # reading the new scale on a backoff or growth (rare) for the log.
        self._host_good, self._host_tolerated, back_off, grow = self._rule().counters(
            self._host_good, self._host_tolerated, overflow
        )
        if back_off:
            scale = self.get_scale()
            logger.info("loss scale backed off to %g after inf/NaN gradients", scale)
            self._emit("backoff", scale)
        elif grow:
            scale = self.get_scale()
            logger.debug("loss scale grew to %g after %d good iterations", scale, self._growth_interval)
            self._emit("growth", scale)

    def _lazy_init(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
            self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=device)
            self._skip_count = torch.tensor(self._init_skip_count, dtype=torch.int64, device=device)
            self._history.append((self._updates, self._scale.clone()))
        return self._scale

    def _require_scale(self, caller: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(
                f"{caller}() was called before scale(): use scaler.scale(loss).backward() earlier in the iteration"
            )
        return self._scale

    def _set_scale(self, scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
        if not isinstance(new_scale, torch.Tensor):
            # A tensor's value is not checked (that would sync): fail_after catches a non-finite one.
            scale.fill_(_checked("scale", new_scale, "new_scale"))
            return
        if not isinstance(new_scale, torch.Tensor) or new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError("new_scale must be a float or a 1-element tensor that does not require grad")
        scale.copy_(new_scale.reshape(()))

    def _rule(self) -> LossScaleRule:
        return LossScaleRule(self._growth_factor, self._backoff_factor, self._growth_interval, self._hysteresis,
                             self._min_scale, self._max_scale)  # fmt: skip

    def _apply_update(self, scale: torch.Tensor, found: torch.Tensor) -> None:
        growth, hysteresis = self._growth_tracker, self._hysteresis_tracker
        assert growth is not None and hysteresis is not None  # set with the scale
        self._rule().update_(scale, growth, hysteresis, found)

    def _count_skips(self, found: torch.Tensor) -> None:
        skips = self._skip_count
        assert skips is not None  # set with the scale
        counted = (found > 0).to(skips.dtype)
        skips[0] += counted  # skipped iterations
        skips[1] = (skips[1] + 1) * counted  # consecutive skipped iterations

    def _maybe_fail_fast(self, host_flags: list[bool | None]) -> None:
        if self._fail_after is None:
            return
        if all(flag is not None for flag in host_flags):
            if any(host_flags):  # only overflowing iterations can trip it; no extra sync otherwise
                self._check_fail_fast()
        elif self._updates % _FUSED_CHECK_INTERVAL == 0:
            self._check_fail_fast()

    def _skip_counts(self) -> tuple[int, int]:
        if self._skip_count is None:
            return self._init_skip_count
        skipped, consecutive = self._skip_count.tolist()
        return int(skipped), int(consecutive)

    def _check_fail_fast(self) -> None:
        assert self._fail_after is not None
        _, consecutive = self._skip_counts()
        if consecutive < self._fail_after:
            return
        floor = self._min_scale if self._min_scale is not None else _DEFAULT_FLOOR
        scale = self.get_scale()
        if not math.isfinite(scale):
            # Set by update(new_scale) with a tensor: backing off cannot make inf or NaN finite.
            raise LossScaleCollapseError(
                f"mixprec.GradScaler: the last {consecutive} iterations all had inf/NaN gradients because the loss "
                f"scale is {scale} (not finite), so every optimizer step was skipped and backing off cannot fix it. "
                "Set a finite scale with scaler.update(new_scale=...) or load_state_dict, "
                "or pass fail_after=None to keep skipping instead."
            )
        if scale > floor:
            return
        raise LossScaleCollapseError(
            f"mixprec.GradScaler: the last {consecutive} iterations all had inf/NaN gradients with the loss "
            f"scale at its floor ({scale:g} <= {floor:g}), so every optimizer step was skipped. Scaling cannot "
            "fix this. Likely causes: the model overflows fp16 in the forward pass (a model trained in bf16, or "
            "activations past 65504: run it in bf16, or keep the overflowing modules in fp32 with a module rule); "
            "the loss or learning rate diverged (check the loss before the first skip; lower the learning rate); "
            "or NaN inputs. Pass fail_after=None to keep skipping instead."
        )

    def _fused_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], scale: torch.Tensor,
                    *args: Any, **kwargs: Any) -> Any:  # fmt: skip
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
            if state["found_inf_per_device"]:
                found = sum(f.to(scale.device, non_blocking=True) for f in state["found_inf_per_device"].values())
                self._last_skipped[id(optimizer)] = found > 0
            return result
        # The optimizer unscales and skips by itself, reading grad_scale and found_inf: no sync.
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        found = sum(f.to(scale.device, non_blocking=True) for f in state["found_inf_per_device"].values())
        found_tensor = found if isinstance(found, torch.Tensor) else torch.zeros_like(scale)
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

    def _run_optimizer_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return optimizer.step(*args, **kwargs)
        except BaseException:
            # The iteration is abandoned: the next scale() starts afresh, update() becomes optional.
            self._failed.add(id(optimizer))
            raise

    def _check_not_failed(self, optimizer: torch.optim.Optimizer, caller: str) -> None:
        # Its gradients may be unscaled already, or its parameters half updated: no retry in this iteration.
        if id(optimizer) in self._failed:
            raise RuntimeError(
                f"{caller}(): optimizer.step() raised an exception earlier in this iteration, so the iteration "
                "was abandoned (the scale did not move). Start the next iteration: optimizer.zero_grad(), "
                "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update(). "
                "Calling scaler.update() after the failed step is optional."
            )

    def _reset_iteration(self) -> None:
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._host_skipped = {}
        self._manual_found = []
        self._manual_flags = []
        self._failed = set()

    # ----- torch.amp.GradScaler's private members, for code written against torch's -----------

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients by ``inv_scale`` in place; flag inf/NaN into per-device copies
        of ``found_inf`` (returned by device), as torch's does. Does not sync.

        Raises:
            ValueError: an fp16 gradient with ``allow_fp16=False`` (torch's rule for its own ``unscale_``).
        """
        with torch.no_grad():
            return _unscale_and_check(_grads_of(optimizer, allow_fp16), inv_scale, found_inf)

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        """Run ``optimizer.step`` unless the recorded checks found inf/NaN. Syncs once per device."""
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))  # the sync
        self._host_skipped[id(optimizer)] = skipped
        self._last_skipped[id(optimizer)] = skipped
        if skipped:
            logger.info("skipped optimizer.step() for %s: gradients hold inf/NaN", _describe(optimizer))
            self._emit("skip", None, _describe(optimizer))
            return None
        return self._run_optimizer_step(optimizer, *args, **kwargs)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them (for optimizers that
        unscale by themselves) and record the flags for ``step`` and ``update``. Does not sync."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.ones((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        found = self._agree(self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The inf/NaN flags recorded for ``optimizer`` in this iteration, by device. Does not sync."""
        found: dict[torch.device, torch.Tensor] = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return found

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor (``None`` before the first ``scale()``). Does not sync."""
        return self._scale

    def _get_growth_tracker(self) -> int:
        """Good iterations in a row toward the next growth (0 when disabled). Syncs."""
        if not self._enabled:
            return 0
        return _item(self._growth_tracker, self._init_growth_tracker)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._require_scale(funcname)
        assert self._growth_tracker is not None  # created with the scale
        return scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._lazy_init(dev)


# What each setting and state-dict entry may hold: (integer?, None allowed?, test, what is valid).
_RULES: dict[str, tuple[bool, bool, Any, str]] = {
    "scale": (False, False, lambda v: 0 < v < math.inf, "positive and finite (the loss scale)"),
    "growth_factor": (False, False, lambda v: 1 < v < math.inf, "> 1.0 and finite (the scale grows by it)"),
    "backoff_factor": (False, False, lambda v: 0 < v < 1, "in (0, 1) (the scale shrinks by it)"),
    "growth_interval": (True, False, lambda v: v >= 1, "a positive number of iterations"),
    "_growth_tracker": (True, False, lambda v: v >= 0, "a count of good iterations, >= 0"),
    "min_scale": (False, True, lambda v: 0 < v < math.inf, "positive and finite, or None (no floor)"),
    "max_scale": (False, True, lambda v: v > 0, "positive, or None (no ceiling)"),
    "hysteresis": (True, False, lambda v: v >= 1, ">= 1 (1 backs off at the first overflow)"),
    "_hysteresis_tracker": (True, False, lambda v: True, "an integer (overflows still tolerated)"),
    "fail_after": (True, True, lambda v: v >= 1, "a positive count or None"),
    "history": (True, False, lambda v: v >= 0, "a count of scale changes, >= 0"),
    "updates": (True, False, lambda v: v >= 0, "a count, >= 0"),
    "skipped_iterations": (True, False, lambda v: v >= 0, "a count, >= 0"),
    "consecutive_skipped": (True, False, lambda v: v >= 0, "a count, >= 0"),
}


def _checked(key: str, value: Any, label: str | None = None) -> Any:
    """``value`` as a float or int (or None where allowed) if it is valid for ``key``.

    Raises:
        TypeError: not a number (bools are not numbers here); the message names ``label`` and what is valid.
        ValueError: a number out of range, NaN, or a non-integer where a count is needed.
    """
    integer, optional, test, valid = _RULES[key]
    label = label or key
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label} must be {valid}, got {value!r} ({type(value).__name__})")
    number = float(value)
    if integer and not number.is_integer():
        raise ValueError(f"{label} must be {valid}, got {value!r} (not an integer)")
    if math.isnan(number) or not test(number):
        raise ValueError(f"{label} must be {valid}, got {value!r}")
    return int(number) if integer else number


def _check_bounds(min_scale: float | None, max_scale: float | None, labels: tuple[str, str]) -> None:
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"{labels[0]} ({min_scale}) must not exceed {labels[1]} ({max_scale})")


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    # fp32 division can be inexact under some compile options: take the reciprocal in fp64.
    return scale.double().reciprocal().float()


def _item(tensor: torch.Tensor | None, default: int) -> int:
    return default if tensor is None else int(tensor.item())


def _describe(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__name__} at {id(optimizer):#x}"


def _grads_source(params: torch.optim.Optimizer | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.optim.Optimizer):
        return [p for group in params.param_groups for p in group["params"]]
    if isinstance(params, torch.Tensor):
        return [params]
    items = list(params)
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"unscale() takes an optimizer, parameters or gradient tensors, got {type(item).__name__}")
    return items


def _first_device(tensors: list[torch.Tensor]) -> torch.device:
    for tensor in tensors:
        grad = tensor.grad if tensor.requires_grad and tensor.is_leaf else tensor
        if grad is not None:
            return grad.device
    return torch.device("cpu")


def _grads_of(optimizer: torch.optim.Optimizer, allow_fp16: bool = True) -> list[torch.Tensor]:
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype is torch.float16:
                raise ValueError(
                    "Attempting to unscale FP16 gradients with allow_fp16=False; pass allow_fp16=True "
                    "(mixprec's unscale_ does: it unscales fp16 gradients in fp32 math)"
                )
            if grad.is_sparse:
                # Coalescing sums duplicate indices; in fp16 that can overflow, so check the result.
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grads.append(grad._values())
            else:
                grads.append(grad)
    return grads


def _unscale_and_check(
    grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Unscale in place and flag inf/NaN with torch's fused kernel, one call per device and dtype.

    The flags go into a copy of ``found_inf`` per device (torch's ``_unscale_grads_`` does the same).
    fp16 and bf16 gradients are unscaled too: the kernel computes in fp32 and rounds once.
    """
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for grad in grads:
        groups[grad.device][grad.dtype].append(grad)
    found_per_device: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, by_dtype in groups.items():
            found = found_per_device[device] = found_inf.to(device=device, non_blocking=True, copy=True)
            device_inv = inv_scale.to(device=device, non_blocking=True, copy=True)
            for same_dtype in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, device_inv)
    return found_per_device
