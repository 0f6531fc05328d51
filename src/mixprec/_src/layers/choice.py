"""The per-layer plan's choice: what each layer measured (:class:`Measured`), the precision chosen for it and why
(:class:`LayerChoice`, :func:`choose`), and a plan applied to a model. Plain data and arithmetic on the
measurements; ``plan`` measures them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from torch import nn

from mixprec._src.fp8.config import Fp8Recipe
from mixprec._src.layers.precision import (
    DELAYED_PER_LAYER,
    LayerPrecision,
    fp8_recipe_of,
    layer_of,
    parse_precision,
    set_layer_precision,
)

__all__ = ["LayerChoice", "Measured", "apply", "check_choices", "choose"]


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer of a per-layer plan: its shape, what each precision cost and how accurate it was, the choice.

    Attributes:
        name: the layer's qualified name.
        shape: e.g. ``"linear 256->512, 1024 rows"``.
        ms: ``(precision, ms)`` pairs: forward and backward of the layer at its shapes (the fastest of 3 runs).
        sqnr_db: ``(precision, dB)`` pairs: the worst of output, input gradient and weight gradient
            against fp32 (fp32 is the reference and has none).
        choice: the precision the layer computes in.
        reason: why, in a sentence.
        noise: how much the layer's timings moved between repetitions (relative; see :mod:`timing`).
        default: the precision the recipe gives the layer without the plan (its dtype, or fp32 where it
            keeps the layer or moves its op to fp32); ``""``: the recipe's dtype (:class:`Recipe` fills it).
    """

    name: str
    shape: str
    ms: tuple[tuple[str, float], ...] = ()
    sqnr_db: tuple[tuple[str, float], ...] = ()
    choice: LayerPrecision = LayerPrecision.FP32
    reason: str = ""
    default: str = ""
    noise: float = 0.0

    def __post_init__(self) -> None:
        for field in ("ms", "sqnr_db"):
            pairs = getattr(self, field)
            items = pairs.items() if isinstance(pairs, dict) else pairs
            object.__setattr__(self, field, tuple((parse_precision(p), float(v)) for p, v in items))
        object.__setattr__(self, "choice", parse_precision(self.choice))
        if self.default:
            object.__setattr__(self, "default", parse_precision(self.default))

    @property
    def moved(self) -> bool:
        """Whether the plan gives this layer another precision than the recipe would."""
        return self.choice != self.default

    def ms_of(self, precision: str) -> float | None:
        return dict(self.ms).get(precision)

    def sqnr_of(self, precision: str) -> float | None:
        return dict(self.sqnr_db).get(precision)


@dataclasses.dataclass
class Measured:
    """Per layer: shape, ms and SQNR by precision, why a precision was not measured, the timings' noise."""

    name: str
    shape: str
    ms: dict[LayerPrecision, float]
    sqnr_db: dict[LayerPrecision, float]
    not_measured: dict[LayerPrecision, str]
    noise: float = 0.0


def choose(
    measured: Sequence[Measured],
    default: str | Callable[[Measured], str],
    floor_db: float,
    min_speedup: float,
    fp8_allowed: bool = True,
) -> tuple[LayerChoice, ...]:
    """Each measured layer's precision (see ``layers.plan``'s docstring); ``default``: what the recipe gives a
    layer (its dtype, or per layer). A block-scaled format measured (never timed: emulated) is chosen by its SQNR
    alone, the least precise one at or above ``floor_db``."""
    choices = []
    recipe_default = default
    for m in measured:
        default = parse_precision(recipe_default(m) if callable(recipe_default) else recipe_default)
        allowed, why_not = {}, []
        for p, ms in m.ms.items():
            quality = m.sqnr_db.get(p, math.inf)
            if quality < floor_db:
                why_not.append(f"{p} {quality:.1f} dB < {floor_db:g} dB")
                continue
            if LayerPrecision.from_name(p).fp8_recipe:
                high = m.ms.get(LayerPrecision.BF16, m.ms.get(default))
                if not fp8_allowed or (high is not None and ms >= high):
                    why_not.append(f"{p} not faster than bf16 ({ms:.3f} vs {high:.3f} ms)" if high else p)
                    continue
            allowed[p] = ms
        fastest = min(allowed, key=allowed.__getitem__)
        need = max(min_speedup, 1.0 + m.noise)  # a speed-up within the timings' noise is not one
        if default in allowed and allowed[default] <= allowed[fastest] * need:
            choice = default
            reason = "as the recipe has it"
            if fastest != default and allowed[default] > allowed[fastest] * min_speedup:
                reason += (
                    f" ({fastest} measured {allowed[default] / allowed[fastest]:.2f}x faster, within the "
                    f"timing noise ±{m.noise:.0%})"
                )
            elif fastest != default:
                reason += f" (within {min_speedup:g}x of {fastest})"
        else:
            choice = fastest
            reason = f"fastest above {floor_db:g} dB"
            if default in m.ms:
                reason += f" ({m.ms[default] / allowed[fastest]:.2f}x faster than {default})"
        block = sorted((p for p in m.sqnr_db if LayerPrecision.from_name(p).block and p not in m.ms), key=_rung)
        for p in block:  # emulated: chosen by SQNR alone, the least precise that holds the floor
            held = m.sqnr_db[p] >= floor_db
            if not held:
                why_not.append(f"{p} {m.sqnr_db[p]:.1f} dB < {floor_db:g} dB")
            elif not LayerPrecision.from_name(choice).block:
                choice = p
                reason = f"{p} by its SQNR ({m.sqnr_db[p]:.1f} dB >= {floor_db:g} dB; emulated here: time not measured)"
        if why_not:
            reason += "; not " + ", ".join(why_not)
        unmeasured: dict[tuple[str, str], list[str]] = {}
        for p, why in m.not_measured.items():
            unmeasured.setdefault(("not timed" if p in m.sqnr_db else "not measured", why), []).append(p)
        reason += "".join(f"; {', '.join(ps)} {what}: {why}" for (what, why), ps in unmeasured.items())
        choices.append(
            LayerChoice(
                m.name,
                m.shape,
                tuple(m.ms.items()),
                tuple(m.sqnr_db.items()),
                parse_precision(choice),
                reason,
                default,
                m.noise,
            )
        )
    return tuple(choices)


def _rung(precision: str) -> int:
    return LayerPrecision.from_name(precision).rung


def apply(model: nn.Module, layers: Sequence[LayerChoice]) -> None:
    """Set each layer the plan moves (its choice is not the recipe's default for it) to its precision (in place)."""
    moved = [c for c in layers if c.moved]
    for layer in moved:  # every name first: a plan for another model changes nothing
        try:
            layer_of(model, layer.name)
        except ValueError as exc:
            raise ValueError(f"the recipe's per-layer plan does not fit this model: {exc}") from None
    for layer in moved:
        set_layer_precision(model, layer.name, layer.choice)


def check_choices(layers: Sequence[LayerChoice]) -> None:
    """Raise for a choice :meth:`Recipe.apply` cannot apply by itself (delayed scaling needs prepare)."""
    for layer in layers:
        if fp8_recipe_of(layer.choice) is Fp8Recipe.DELAYED:
            raise ValueError(f"layer {layer.name!r}: {DELAYED_PER_LAYER}")
