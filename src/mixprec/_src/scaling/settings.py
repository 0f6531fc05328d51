"""GradScaler's settings and state dict: what each entry may hold, checked with messages that say so."""

from __future__ import annotations

import math
import numbers
from collections import abc
from typing import Any

from mixprec._src.scaling.loss_scale import LossScaleRule, LossScaleState

__all__ = ["TORCH_KEYS", "check_bounds", "checked", "from_state_dict", "to_state_dict"]

# (integer?, None allowed?, test, what is valid), by setting or state-dict key.
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


def checked(key: str, value: Any, label: str | None = None) -> Any:
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


def check_bounds(min_scale: float | None, max_scale: float | None, labels: tuple[str, str]) -> None:
    """Raises ValueError when the floor is above the ceiling."""
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"{labels[0]} ({min_scale}) must not exceed {labels[1]} ({max_scale})")


# torch.amp.GradScaler's keys, first in every state dict, so torch's scaler loads ours.
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def to_state_dict(rule: LossScaleRule, fail_after: int | None, updates: int, state: LossScaleState) -> dict[str, Any]:
    """Every field needed to resume, torch's keys first."""
    return {
        "scale": state.scale,
        "growth_factor": rule.growth_factor,
        "backoff_factor": rule.backoff_factor,
        "growth_interval": rule.growth_interval,
        "_growth_tracker": state.good,
        "min_scale": rule.min_scale,
        "max_scale": rule.max_scale,
        "hysteresis": rule.hysteresis,
        "_hysteresis_tracker": state.tolerated,
        "fail_after": fail_after,
        "updates": updates,
        "skipped_iterations": state.skipped,
        "consecutive_skipped": state.consecutive,
    }


def from_state_dict(
    state_dict: Any, rule: LossScaleRule, fail_after: int | None
) -> tuple[LossScaleRule, int | None, int, LossScaleState]:
    """``(rule, fail_after, updates, state)`` from a state dict of GradScaler's or torch's; what a
    torch state dict lacks keeps ``rule``'s and ``fail_after``'s values.

    Raises:
        RuntimeError: an empty dict (saved from a disabled scaler).
        ValueError: missing torch keys, unknown keys, or a value out of range; the message names the key.
        TypeError: not a dict, or a value that is not a number; the message names the key.
    """
    if not isinstance(state_dict, abc.Mapping):
        raise TypeError(f"load_state_dict takes the dict from state_dict(), got {type(state_dict).__name__}")
    if not state_dict:
        raise RuntimeError("the state dict is empty, probably saved from a disabled GradScaler; nothing to resume from")
    extras = {
        "min_scale": rule.min_scale,
        "max_scale": rule.max_scale,
        "hysteresis": rule.hysteresis,
        "_hysteresis_tracker": rule.hysteresis,
        "fail_after": fail_after,
        "updates": 0,
        "skipped_iterations": 0,
        "consecutive_skipped": 0,
    }
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    unknown = sorted(map(str, set(state_dict) - set(TORCH_KEYS) - set(extras)))
    if missing or unknown:
        raise ValueError(
            f"not a GradScaler state dict: missing {missing}, unknown {unknown}; "
            f"expected {list(TORCH_KEYS)} and optionally {list(extras)}"
        )
    values = {**extras, **state_dict}
    if "_hysteresis_tracker" not in state_dict:
        values["_hysteresis_tracker"] = values["hysteresis"]
    v = {key: checked(key, value, f"state_dict[{key!r}]") for key, value in values.items()}
    check_bounds(v["min_scale"], v["max_scale"], ("state_dict['min_scale']", "state_dict['max_scale']"))
    loaded_rule = LossScaleRule(
        v["growth_factor"], v["backoff_factor"], v["growth_interval"], v["hysteresis"], v["min_scale"], v["max_scale"]
    )
    state = LossScaleState(
        v["scale"], v["_growth_tracker"], v["_hysteresis_tracker"], v["skipped_iterations"], v["consecutive_skipped"]
    )
    return loaded_rule, v["fail_after"], v["updates"], state
