"""The per-layer plans of tune's candidates: each layer's measurements (``layers.plan``), and each recipe's plan
chosen from them (``layers.choice``), attached to the recipe tune returns with what became of it; and
:func:`plan_layers`, the plan on its own (with the block-scaled formats, which tune does not race).

Everything here syncs with the device: it times GEMMs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src import input_checks
from mixprec._src.dtypes import parse_dtype
from mixprec._src.layers import choice as layer_choice
from mixprec._src.layers import plan as layer_plan
from mixprec._src.layers.precision import LayerPrecision, parse_precision
from mixprec._src.prepare.config import Level
from mixprec._src.tune.recipe import Recipe

__all__ = ["LayerPlans", "plan_layers"]


@dataclasses.dataclass
class LayerPlans:
    """The per-layer measurements, and how a recipe's layers are chosen from them."""

    measured: list[layer_choice.Measured]
    floor_db: float
    min_speedup: float
    outcome: dict[str, str] = dataclasses.field(default_factory=dict)  # recipe name -> what its plan became

    def choices(self, recipe: Recipe) -> tuple[layer_choice.LayerChoice, ...]:
        """The plan for ``recipe``: each layer's default is what the recipe gives it."""
        return layer_choice.choose(
            self.measured, lambda m: recipe.layer_default(m.name, m.shape), self.floor_db, self.min_speedup
        )

    def planned(self, recipe: Recipe) -> Recipe | None:
        """``recipe`` with its per-layer plan, or ``None`` where every layer stays as the recipe has it."""
        planned = dataclasses.replace(recipe, layers=self.choices(recipe))
        return planned if planned.moved_layers else None

    def attach(self, recipe: Recipe) -> Recipe:
        """The chosen recipe with the plan's table (choices reset to its defaults if it is not the planned one)."""
        if recipe.layers:
            return recipe
        choices = self.choices(recipe)
        if not any(c.moved for c in choices):
            note = "per-layer plan: every layer stays as the recipe has it"
            return dataclasses.replace(recipe, layers=choices, notes=(*recipe.notes, note))
        if recipe.name in self.outcome:
            why = self.outcome[recipe.name]
            why += f", but {recipe.name} was faster" if why.endswith("passed") else ""
        elif self.outcome:
            why = (
                f"{recipe.name} won the final round; round 4 raced the plans of "
                f"{', '.join(self.outcome)}, the best of each dtype then"
            )
        else:
            why = "the budget ran out before round 4 raced it"
        kept = tuple(
            c
            if not c.moved
            else dataclasses.replace(
                c, choice=parse_precision(c.default), reason=f"{c.choice} measured best, not applied; {c.reason}"
            )
            for c in choices
        )
        return dataclasses.replace(recipe, layers=kept, notes=(*recipe.notes, f"per-layer plan not applied: {why}"))


def plan_layers(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    precisions: Sequence[str] = ("nvfp4", "mxfp8", "bf16"),
    dtype: torch.dtype | str = "bf16",
    level: Level | str = "O1",
    sqnr_db: float = 20.0,
    min_speedup: float = 1.02,
    budget_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> Recipe:
    """A recipe at ``dtype`` and ``level`` whose layers are each planned on ``batch``, as :func:`mixprec.tune`
    plans them but without its search: every GEMM layer is run at its shapes in each of ``precisions`` (and
    fp32, the reference) and gets the fastest precision whose SQNR holds ``sqnr_db`` (the recipe's dtype where
    within ``min_speedup`` of it). A block-scaled format (``"nvfp4"``, ``"mxfp8"``) is chosen by its SQNR
    alone, the least precise one holding the floor: its GEMMs are emulated, so its time here is not the
    hardware's. ``model`` is not changed; ``recipe.apply(model, optimizer)`` prepares it with the plan, and
    ``print(recipe.table())`` shows each layer's SQNR, time and reason.

    The loss is ``loss_fn(model(batch))`` (default: the mean square of the floating outputs).
    """
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    loss_of = functools.partial(input_checks.scalar_loss, loss_fn=loss_fn)
    wanted = [parse_precision(p) for p in precisions]
    measured, notes = layer_plan.measure(model, batch, loss_of, wanted, time.perf_counter() + budget_s, None, progress)
    recipe = Recipe(dtype=parse_dtype(dtype, what="recipe dtype"), level=Level.from_name(level))
    choices = layer_choice.choose(measured, lambda m: recipe.layer_default(m.name, m.shape), sqnr_db, min_speedup)
    block = sum(1 for c in choices if LayerPrecision.from_name(c.choice).block)
    notes.append(f"per-layer plan: {block} of {len(choices)} layers in a block-scaled format")
    return dataclasses.replace(recipe, layers=choices, notes=tuple(notes))
