"""Fail fast: raise when loss scaling cannot help, instead of skipping every step for ever.

A run whose iterations all overflow with the scale at its floor (or not finite) skips every
optimizer step; :func:`check` turns that into a :class:`~mixprec.LossScaleCollapseError` that
says what to try. :func:`due` says when to look without adding syncs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mixprec._src.errors import LossScaleCollapseError

__all__ = ["DEFAULT_FLOOR", "FUSED_CHECK_INTERVAL", "check", "due"]

# With no min_scale, a scale at or below this counts as "at the floor".
DEFAULT_FLOOR = 1.0
# Fused optimizers report found_inf only on the device: the check reads it this often.
FUSED_CHECK_INTERVAL = 100


def due(host_flags: list[bool | None], updates: int) -> bool:
    """Whether to check after an update whose overflow flags the host read as ``host_flags``
    (``None`` for a fused optimizer's, which the host never read)."""
    if all(flag is not None for flag in host_flags):
        return any(host_flags)  # only overflowing iterations can trip it: no extra sync otherwise
    return updates % FUSED_CHECK_INTERVAL == 0


def check(consecutive: int, fail_after: int, min_scale: float | None, read_scale: Callable[[], float]) -> None:
    """Raise when ``fail_after`` iterations in a row overflowed with the scale at its floor or not finite.

    ``read_scale()`` syncs; it is called only once ``consecutive`` reaches ``fail_after``.

    Raises:
        LossScaleCollapseError: the message says why scaling cannot fix it and what to try.
    """
    if consecutive < fail_after:
        return
    floor = min_scale if min_scale is not None else DEFAULT_FLOOR
    scale = read_scale()
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
