"""Which of a model's GEMMs each per-layer feature reaches, by share of the forward's FLOPs, and why not.

``mixprec.gemm_reach(model, batch)`` runs one forward of a copy of ``model`` (no gradients) and
counts each GEMM's FLOPs (``gemms.flops``): those of each GEMM layer (``gemms.sites``), those of
GEMMs with a weight outside every layer (a module that is not a layer kind mixprec reaches: a
subclass with its own forward, an attention it cannot route), and those between activations
(attention's scores and values, which no layer holds). Per layer it says whether fp8 conversion
reaches it (or why not: the output head, CUDA's shape rules, a convolution) and that per-layer
precision, the per-layer plan and the guard do. The copy's forward syncs as a forward does.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from mixprec._src import input_checks
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8.config import Fp8Config, as_fp8_config
from mixprec._src.gemms import flops, sites

__all__ = ["FEATURES", "GemmReach", "ReachedLayer", "gemm_reach"]

#: The features a reach report covers: fp8 conversion, and per-layer precision / the plan / the guard.
FEATURES = ("fp8", "per-layer")
_HEAD, _SHAPE = "the output head", "not a multiple of 16"


@dataclasses.dataclass
class ReachedLayer:
    """One GEMM layer: its kind, forward FLOPs, calls, and per feature ``None`` (reached) or why not."""

    name: str
    kind: str
    flops: int
    calls: int
    why_not: dict[str, str | None]


@dataclasses.dataclass
class GemmReach:
    """A forward's GEMM FLOPs, by layer and by what no layer holds.

    Attributes:
        layers: the GEMM layers, in ``named_modules`` order.
        outside: ``(module name, FLOPs, reason)`` of GEMMs with a weight that no layer holds.
        activation_flops: FLOPs of GEMMs between activations (attention's scores and values).
    """

    model: str
    layers: list[ReachedLayer]
    outside: list[tuple[str, int, str]]
    activation_flops: int

    @property
    def weight_flops(self) -> int:
        """FLOPs of every GEMM with a weight (the layers' and the rest's)."""
        return sum(r.flops for r in self.layers) + sum(f for _, f, _ in self.outside)

    def reached(self, feature: str) -> int:
        return sum(r.flops for r in self.layers if r.why_not[feature] is None)

    def share(self, feature: str) -> float:
        """The share of the weight GEMMs' FLOPs ``feature`` reaches."""
        return self.reached(feature) / self.weight_flops if self.weight_flops else 0.0

    def share_of_rest(self, feature: str) -> float:
        """The share it reaches of the GEMMs neither the output head nor CUDA's shape rules exclude."""
        whys = [(r.flops, r.why_not[feature] or "") for r in self.layers]
        excluded = sum(f for f, why in whys if why.startswith(_HEAD) or _SHAPE in why)
        rest = self.weight_flops - excluded
        return self.reached(feature) / rest if rest else 0.0

    def left_out(self, feature: str) -> list[tuple[str, int, str]]:
        """``(name, FLOPs, reason)`` of what ``feature`` does not reach (layers, then modules outside them)."""
        rows = [(r.name, r.flops, r.why_not[feature] or "") for r in self.layers if r.why_not[feature] is not None]
        return rows + self.outside

    def __str__(self) -> str:
        total = self.weight_flops
        lines = [
            f"{self.model}: {len(self.layers)} GEMM layers, {total / 1e6:.1f} MFLOP of weight GEMMs per forward "
            f"(+{self.activation_flops / 1e6:.1f} between activations: attention's scores and values)"
        ]
        for feature in FEATURES:
            lines.append(
                f"  {feature}: {self.share(feature):.1%} of the weight GEMMs' FLOPs, "
                f"{self.share_of_rest(feature):.1%} of those the head and CUDA's shape rules leave"
            )
            for name, f, why in self.left_out(feature):
                lines.append(f"    left out {name or '<model>'} ({f / total if total else 0:.1%}): {why}")
        never = [r.name for r in self.layers if r.calls == 0]
        if never:
            lines.append(f"  never called in this forward: {', '.join(never)}")
        return "\n".join(lines)


def _fp8_reasons(model: nn.Module, found: list[tuple[str, nn.Module, Any]], config: Fp8Config) -> dict[str, str | None]:
    converted = fp8_conversion.fp8_layers(model)
    if converted is not None:  # what prepare did (kept modules and names included)
        skipped = dict(converted.skipped)
        return {n: (None if n in converted.modules else skipped.get(n, "not converted")) for n, _, _ in found}
    head = fp8_conversion.head_of(model, found)
    reasons = {n: fp8_conversion.reason_to_skip(m, n, config, False, head) for n, m, _ in found}
    for name in fp8_conversion.kept_last(config, [n for n, why in reasons.items() if why is None]):
        reasons[name] = (
            f"one of the last {config.kept_fraction:.0%} of the layers, which {config.recipe} leaves in bf16"
        )
    return reasons


def gemm_reach(model: nn.Module, batch: Any, fp8: Fp8Config | str | None = None) -> GemmReach:
    """What share of ``model``'s forward GEMM FLOPs fp8 and the per-layer features reach, and what they leave out.

    Args:
        model: the model (prepared or not; it is copied, not changed).
        batch: one batch, as the model takes it (a tensor, a tuple of arguments or a dict of keyword arguments).
        fp8: the fp8 config to judge by where the model has none converted (default ``Fp8Config()``).

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
        >>> reach = mixprec.gemm_reach(model, torch.randn(8, 32))
        >>> round(reach.share("per-layer"), 3), round(reach.share("fp8"), 3)
        (1.0, 0.762)
    """
    config = as_fp8_config(fp8) or Fp8Config()
    copied = copy.deepcopy(model)
    found = sites.gemm_layers(copied)
    fp8_why = _fp8_reasons(copied, found, config)
    with torch.no_grad():
        counted = flops.count(copied, [n for n, _, _ in found], lambda: input_checks.call_model(copied, batch))
    left = dict(sites.left_out(copied))
    layers = [
        ReachedLayer(n, str(k), counted.layers[n], counted.calls[n], {"fp8": fp8_why[n], "per-layer": None})
        for n, _, k in found
    ]
    outside = []
    for where, f in counted.weights.items():
        owner = next((n for n in sorted(left, key=len, reverse=True) if where == n or where.startswith(n + ".")), None)
        reason = left[owner] if owner is not None else "a GEMM with a weight in a module that is not a GEMM layer"
        outside.append((owner if owner is not None else where, f, reason))
    return GemmReach(type(model).__name__, layers, outside, sum(counted.activations.values()))
