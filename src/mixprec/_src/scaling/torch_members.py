"""The state a :class:`GradScaler` holds, and torch.amp.GradScaler's private members over it: what code written
against torch's scaler (its fused optimizers, its tests) reaches into. ``GradScaler`` inherits them.

Each member says whether it syncs.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch

from mixprec._src.scaling import unscaling
from mixprec._src.scaling.events import EventLog
from mixprec._src.scaling.iteration import Iteration, describe
from mixprec._src.scaling.loss_scale import DeviceLossScale, LossScaleState

__all__ = ["ScalerState"]


class ScalerState:
    """A scaler's state and the members that read it (see the module)."""

    _enabled: bool
    _initial: LossScaleState  # the state as numbers until the first scale() puts it on the loss's device
    _device_state: DeviceLossScale | None
    _iteration: Iteration
    _last_skipped: dict[int, bool | torch.Tensor]
    _updates: int
    _events: EventLog
    _process_group: Any

    def _current(self) -> LossScaleState:
        """The state as numbers (syncs once it lives on a device)."""
        return self._initial if self._device_state is None else self._device_state.read()

    def _skip_counts(self) -> tuple[int, int]:
        """(skipped, consecutive skipped) iterations; one sync once the state lives on a device."""
        if self._device_state is None:
            return self._initial.skipped, self._initial.consecutive
        return self._device_state.skip_counts()

    def _lazy_init(self, device: torch.device) -> torch.Tensor:
        if self._device_state is None:
            self._device_state = DeviceLossScale(self._initial, device)
            self._events.record(self._updates, self._device_state.scale)
        return self._device_state.scale

    def _require_scale(self, caller: str) -> torch.Tensor:
        if self._device_state is None:
            raise RuntimeError(
                f"{caller}() was called before scale(): use scaler.scale(loss).backward() earlier in the iteration"
            )
        return self._device_state.scale

    def _run_optimizer_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return optimizer.step(*args, **kwargs)
        except BaseException:
            # The iteration is abandoned: the next scale() starts afresh, update() becomes optional.
            self._iteration.failed.add(id(optimizer))
            raise

    def _check_not_failed(self, optimizer: torch.optim.Optimizer, caller: str) -> None:
        # Its gradients may be unscaled already, or its parameters half updated: no retry in this iteration.
        if id(optimizer) in self._iteration.failed:
            raise RuntimeError(
                f"{caller}(): optimizer.step() raised an exception earlier in this iteration, so the iteration "
                "was abandoned (the scale did not move). Start the next iteration: optimizer.zero_grad(), "
                "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update(). "
                "Calling scaler.update() after the failed step is optional."
            )

    # ----- torch.amp.GradScaler's private members, for code written against torch's -----------

    @property
    def _scale(self) -> torch.Tensor | None:
        return None if self._device_state is None else self._device_state.scale

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return None if self._device_state is None else self._device_state.good

    @property
    def _init_growth_tracker(self) -> int:
        return self._initial.good

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        self._initial = dataclasses.replace(self._initial, good=value)

    @property
    def _per_optimizer_states(self) -> defaultdict[int, dict[str, Any]]:
        return self._iteration.per_optimizer

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients by ``inv_scale`` in place; flag inf/NaN into per-device copies
        of ``found_inf`` (returned by device), as torch's does. Does not sync.

        Raises:
            ValueError: an fp16 gradient with ``allow_fp16=False`` (torch's rule for its own ``unscale_``).
        """
        with torch.no_grad():
            return unscaling.unscale_and_check(unscaling.grads_of(optimizer, allow_fp16), inv_scale, found_inf)

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``optimizer.step`` unless the recorded checks found inf/NaN. Syncs once per device."""
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))  # the sync
        self._iteration.host_skipped[id(optimizer)] = skipped
        self._last_skipped[id(optimizer)] = skipped
        if skipped:
            self._events.skipped(describe(optimizer), self._updates)
            return None
        return self._run_optimizer_step(optimizer, *args, **kwargs)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them (for optimizers that
        unscale by themselves) and record the flags for ``step`` and ``update``. Does not sync."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.ones((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        found = unscaling.agree(self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True), self._process_group)
        self._iteration.per_optimizer[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The inf/NaN flags recorded for ``optimizer`` in this iteration, by device. Does not sync."""
        found: dict[torch.device, torch.Tensor] = self._iteration.per_optimizer[id(optimizer)]["found_inf_per_device"]
        return found

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor (``None`` before the first ``scale()``). Does not sync."""
        return self._scale

    def _get_growth_tracker(self) -> int:
        """Good iterations in a row toward the next growth (0 when disabled). Syncs."""
        if not self._enabled:
            return 0
        return self._initial.good if self._device_state is None else int(self._device_state.good.item())

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._require_scale(funcname)
        assert self._device_state is not None  # made with the scale
        return scale, self._device_state.good

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._lazy_init(dev)
