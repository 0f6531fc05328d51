"""The errors mixprec raises, by kind, so programs can catch what they can act on.

Each derives from :class:`MixprecError` and from the built-in type it was raised as before
(``ValueError`` or ``RuntimeError``), so existing ``except ValueError`` code keeps working.
Every message says what went wrong and what to do.
"""

from __future__ import annotations

__all__ = ["CheckpointReplayError", "LossScaleCollapseError", "MixprecError", "PolicyError", "PrepareOrderError"]


class MixprecError(Exception):
    """Base of every error specific to mixprec."""


class PolicyError(MixprecError, ValueError):
    """A policy, op name, module rule or policy string that is not valid."""


class CheckpointReplayError(MixprecError, RuntimeError):
    """Activation checkpointing would recompute under other precision than the forward ran in."""


class LossScaleCollapseError(MixprecError, RuntimeError):
    """GradScaler skipped ``fail_after`` steps in a row and scaling cannot recover (fail-fast)."""


class PrepareOrderError(MixprecError, RuntimeError):
    """``prepare`` and ``fully_shard`` (or the optimizer) were set up in an order that cannot train right."""


for _error in (MixprecError, PolicyError, CheckpointReplayError, LossScaleCollapseError, PrepareOrderError):
    _error.__module__ = "mixprec"  # shown as mixprec.PolicyError, the name users import
