"""The per-layer plans of tune's candidates: each layer's measurements (``layers.plan``), and each recipe's plan
chosen from them (``layers.choice``), attached to the recipe tune returns with what became of it."""

from __future__ import annotations

import dataclasses

from mixprec._src.layers import choice as layer_choice
from mixprec._src.layers.precision import parse_precision
from mixprec._src.tune.recipe import Recipe

__all__ = ["LayerPlans"]


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
