"""A memory budget for :func:`mixprec.tune`: which recipes fit, and what each gives up to fit.

Every candidate's peak comes from :func:`mixprec.memory_plan` (the model's shapes on fake tensors:
nothing runs). A level whose plain recipe does not fit tries, in order, what costs least: the step in
backward (the same numbers, no gradient accumulation), then fp8 optimizer state (the fastest
quantized step), then both, then 8-bit and 4-bit state with the step in backward. The first that
fits is the level's candidate; where no level fits in any variant, :class:`Fit` refuses with the
smallest peak any reaches.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src.dtypes import short_name
from mixprec._src.observe.memory_plan import memory_plan
from mixprec._src.step import state_checks
from mixprec._src.step import step_in_backward as in_backward
from mixprec._src.tune.recipe import Recipe

__all__ = ["VARIANTS", "Fit", "parse_bytes"]

#: what a level may give up to fit, cheapest first
VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"step_in_backward": True},
    {"optimizer_state": "bf16"},
    {"optimizer_state": "fp8"},
    {"optimizer_state": "fp8", "step_in_backward": True},
    {"optimizer_state": "8bit", "step_in_backward": True},
    {"optimizer_state": "4bit", "step_in_backward": True},
)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """``"24GiB"``, ``"500 MB"``, ``2**30``: a number of bytes.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = float(value)
    else:
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = found.group(2).lower() if found else ""
        if found is None or unit not in _UNITS:
            raise ValueError(f"memory_budget must be a size like '24GiB', '500MB' or a number of bytes, not {value!r}")
        size = float(found.group(1)) * _UNITS[unit]
    if not size > 0:
        raise ValueError(f"memory_budget must be positive, not {value!r}")
    return int(size)


def _mib(size: int) -> str:
    """``size`` bytes in the unit that shows it with a few digits (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size / 2**10:.1f} KiB"


class Fit:
    """The recipes that fit in ``budget`` bytes (peak per rank, activations of ``batch`` included)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        loss_of: Callable[[Any], torch.Tensor],
        budget: int,
    ) -> None:
        self.model, self.optimizer, self.batch, self.loss_of, self.budget = model, optimizer, batch, loss_of, budget
        self.peaks: dict[str, int] = {}
        self.seconds = 0.0  # spent planning: outside tune's budget_s, which is for measuring

    def peak(self, recipe: Recipe) -> int:
        """``recipe``'s predicted peak in bytes (cached by name)."""
        if recipe.name not in self.peaks:
            begin = time.perf_counter()
            plan = memory_plan(self.model, self.optimizer, recipe, batch=self.batch, loss_fn=self.loss_of)
            assert plan.peak is not None
            self.peaks[recipe.name] = plan.peak
            self.seconds += time.perf_counter() - begin
        return self.peaks[recipe.name]

    def fits(self, recipe: Recipe) -> bool:
        return self.peak(recipe) <= self.budget

    def changes(self, base: Recipe) -> dict[str, Any] | None:
        """The cheapest variant of ``base`` that fits (``{}``: as it is), or ``None`` where none does."""
        for variant in self.variants(base):
            if self.fits(_with(base, variant)):
                return variant
        return None

    def variants(self, base: Recipe) -> list[dict[str, Any]]:
        """What ``base`` may give up to fit: what prepare takes with this optimizer and dtype."""
        if base.dtype is torch.float32:
            return [{}]
        return [v for v in VARIANTS if self._possible(v, base.dtype)]

    def _possible(self, variant: dict[str, Any], dtype: torch.dtype) -> bool:
        try:
            if variant.get("step_in_backward"):
                if dtype is torch.float16:
                    return False
                in_backward.check(self.optimizer)
            if "optimizer_state" in variant:
                state_checks.check(self.optimizer, variant["optimizer_state"])
        except ValueError:
            return False
        return True

    def check(self, bases: Sequence[Recipe]) -> list[str]:
        """Raise where no variant of any of ``bases`` fits; else a note for each base that had to give up."""
        notes, smallest = [], None
        for base in bases:
            variant = self.changes(base)
            if variant is None:
                for v in self.variants(base):
                    candidate = _with(base, v)
                    if smallest is None or self.peak(candidate) < smallest[0]:
                        smallest = (self.peak(candidate), candidate.name)
            elif variant:
                fitted = _with(base, variant)
                notes.append(
                    f"memory budget {_mib(self.budget)}: {base.name} needs {_mib(self.peak(base))}; "
                    f"{fitted.name} fits in {_mib(self.peak(fitted))}"
                )
        if all(self.changes(b) is None for b in bases):
            assert smallest is not None
            raise ValueError(
                f"no recipe fits in a memory budget of {_mib(self.budget)}: the smallest, "
                f"{smallest[1]}, needs {_mib(smallest[0])} at this batch (mixprec.memory_plan). "
                "Use a smaller batch, activation checkpointing, more FSDP2 ranks, or a larger "
                "budget"
            )
        return notes

    def gave_up(self, recipe: Recipe) -> str:
        """What ``recipe`` gave up to fit, in words ('' where nothing)."""
        lost = []
        if recipe.step_in_backward:
            lost.append("gradient accumulation (each backward steps the parameters)")
        if recipe.optimizer_state.own:
            lost.append(
                f"the optimizer state's precision ({recipe.optimizer_state} instead of "
                f"{'bf16' if recipe.level.bf16_weights else 'fp32'})"
            )
        if not lost:
            return ""
        return (
            f"memory budget {_mib(self.budget)}: {recipe.name} needs {_mib(self.peak(recipe))}; to fit it gave "
            f"up {' and '.join(lost)}"
        )

    def describe(self, recipe: Recipe) -> str:
        return f"{recipe.name} ({short_name(recipe.dtype)}) needs {_mib(self.peak(recipe))}"


def _with(base: Recipe, variant: dict[str, Any]) -> Recipe:
    import dataclasses

    return dataclasses.replace(base, **variant) if variant else base
