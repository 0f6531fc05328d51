"""What :func:`mixprec.diagnose` found, as data: per-module statistics and what to do.

:class:`DiagnosticReport` round-trips through JSON (``to_dict``/``from_dict``); its table (rich)
and plot (matplotlib) are drawn by the functions at the end, with their libraries imported there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import torch

from mixprec._src.dtypes import parse_dtype, short_name
from mixprec._src.policy.grammar import get_policy
from mixprec._src.policy.rules import ModuleRule, Policy

__all__ = [
    "DiagnosticReport",
    "Fp8LayerReport",
    "ModuleReport",
    "NonFinite",
    "TensorStats",
    "diagnostic_plot",
    "diagnostic_table",
]


@dataclasses.dataclass
class TensorStats:
    """Statistics of the tensors one module produced (or received as gradient) in one pass."""

    numel: int = 0
    absmax: float = 0.0
    min_nonzero: float = math.inf
    overflow: int = 0  # finite values past the dtype's largest, plus infs
    underflow: int = 0  # non-zeros below the dtype's smallest normal
    nan: int = 0
    inf: int = 0

    def add(self, t: torch.Tensor, finfo: torch.finfo) -> None:
        t = t.detach()
        if not t.is_floating_point() or t.numel() == 0:
            return
        x = t.float()
        finite = torch.isfinite(x)
        mag = x.abs()
        self.numel += t.numel()
        self.nan += int(torch.isnan(x).sum())
        self.inf += int(torch.isinf(x).sum())
        self.overflow += int(((mag > finfo.max) & finite).sum()) + int(torch.isinf(x).sum())
        self.underflow += int(((mag < finfo.tiny) & (mag > 0)).sum())
        if finite.any():
            self.absmax = max(self.absmax, float(mag[finite].max()))
            nonzero = mag[finite & (mag > 0)]
            if nonzero.numel():
                self.min_nonzero = min(self.min_nonzero, float(nonzero.min()))

    @property
    def overflow_frac(self) -> float:
        return self.overflow / self.numel if self.numel else 0.0

    @property
    def underflow_frac(self) -> float:
        return self.underflow / self.numel if self.numel else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "absmax": self.absmax,
            "min_nonzero": None if math.isinf(self.min_nonzero) else self.min_nonzero,
            "overflow_frac": self.overflow_frac,
            "underflow_frac": self.underflow_frac,
            "overflow": self.overflow,
            "underflow": self.underflow,
            "nan": self.nan,
            "inf": self.inf,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorStats:
        """The statistics :meth:`to_dict` wrote."""
        low = data["min_nonzero"]
        return cls(
            numel=data["numel"],
            absmax=data["absmax"],
            min_nonzero=math.inf if low is None else low,
            overflow=data["overflow"],
            underflow=data["underflow"],
            nan=data["nan"],
            inf=data["inf"],
        )


@dataclasses.dataclass
class ModuleReport:
    """One module.

    ``activations`` and ``gradients`` are the fp32 run's values measured against the target
    dtype's range: what would overflow, or flush to subnormal or zero, in that dtype (a flushed
    gradient is a legal-looking zero in the low-precision run itself). ``nan``/``inf`` count what
    the low-precision run actually produced, forward and backward; ``rel_error`` compares its
    forward output with fp32's.
    """

    name: str
    type: str
    activations: TensorStats
    gradients: TensorStats
    nan: int
    inf: int
    rel_error: float | None  # ||y_low - y_fp32|| / ||y_fp32|| of the forward output

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "activations": self.activations.to_dict(),
            "gradients": self.gradients.to_dict(),
            "nan": self.nan,
            "inf": self.inf,
            "rel_error": self.rel_error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModuleReport:
        """The module :meth:`to_dict` wrote."""
        return cls(
            name=data["name"],
            type=data["type"],
            activations=TensorStats.from_dict(data["activations"]),
            gradients=TensorStats.from_dict(data["gradients"]),
            nan=data["nan"],
            inf=data["inf"],
            rel_error=data["rel_error"],
        )


@dataclasses.dataclass
class Fp8LayerReport:
    """One fp8 layer: its SQNR (dB) and, per cast role, ``amax``, ``scale``, ``saturated``, ``flushed``.

    In a block-scaled layer (``block``: MXFP8, NVFP4) ``saturated`` is the share of *blocks* whose values clipped
    at the element format's largest value, ``scale`` the smallest multiplier a block got."""

    name: str
    sqnr: float
    casts: dict[str, dict[str, float]]
    block: bool = False

    def worst_saturation(self) -> float:
        return max((c["saturated"] for c in self.casts.values()), default=0.0)

    def worst_flush(self) -> float:
        return max((c["flushed"] for c in self.casts.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sqnr": self.sqnr, "casts": self.casts, "block": self.block}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fp8LayerReport:
        casts = {k: dict(v) for k, v in data["casts"].items()}
        return cls(data["name"], float(data["sqnr"]), casts, bool(data.get("block", False)))

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.sqnr:.1f} dB, saturated {'blocks ' if self.block else ''}"
            f"{self.worst_saturation():.2%}, flushed {self.worst_flush():.2%}"
        )


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where the first NaN or Inf came from finite inputs."""

    module: str
    module_type: str
    pass_: str  # "forward" or "backward"
    op: str | None
    kind: str  # "nan" or "inf"

    def __str__(self) -> str:
        op = f" in {self.op}" if self.op else ""
        where = self.module or "<model>"
        return f"{self.kind} first appears in the {self.pass_} pass of {where} ({self.module_type}){op}"


@dataclasses.dataclass
class DiagnosticReport:
    """What :func:`diagnose` found; see the module docstring."""

    dtype: torch.dtype
    modules: list[ModuleReport]
    first_nonfinite: NonFinite | None
    keep_fp32: list[str]
    rules_fix_it: bool | None  # whether the run with the rules applied was free of overflow and NaN
    suggested_loss_scale: float
    bf16_avoids_it: bool | None
    notes: list[str]
    loss: float | None
    loss_fp32: float | None
    fp8: list[Fp8LayerReport] = dataclasses.field(default_factory=list)  # worst SQNR first

    def fp8_worst(self, n: int = 3) -> list[str]:
        """The fp8 layers that lose most (lowest SQNR), at most ``n``."""
        return [r.name for r in self.fp8[:n]]

    def rules(self) -> tuple[ModuleRule, ...]:
        """Per-module rules that keep the flagged modules in fp32, for a Policy or autocast."""
        return (ModuleRule(names=tuple(self.keep_fp32)),) if self.keep_fp32 else ()

    def policy(self, base: Policy | str = "cpu") -> Policy:
        """``base`` with :meth:`rules` added: pass it to ``mixprec.autocast(policy=...)``."""
        policy = get_policy(base)
        return policy.with_rules((*policy.module_rules, *self.rules()))

    def overflowing(self) -> list[str]:
        """Modules whose activations overflow the dtype (or hold Inf), most affected first."""
        hit = [m for m in self.modules if m.activations.overflow or m.inf]
        return [m.name for m in sorted(hit, key=lambda m: -m.activations.overflow_frac)]

    def underflowing(self) -> list[str]:
        """Modules whose incoming gradients underflow the dtype, most affected first."""
        hit = [m for m in self.modules if m.gradients.underflow_frac > 0]
        return [m.name for m in sorted(hit, key=lambda m: -m.gradients.underflow_frac)]

    def module(self, name: str) -> ModuleReport:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module {name!r} in the report; modules: {[m.name for m in self.modules]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "dtype": short_name(self.dtype),
            "first_nonfinite": None if self.first_nonfinite is None else dataclasses.asdict(self.first_nonfinite),
            "keep_fp32": self.keep_fp32,
            "rules_fix_it": self.rules_fix_it,
            "suggested_loss_scale": self.suggested_loss_scale,
            "bf16_avoids_it": self.bf16_avoids_it,
            "notes": self.notes,
            "loss": self.loss,
            "loss_fp32": self.loss_fp32,
            "modules": [m.to_dict() for m in self.modules],
            "fp8": [r.to_dict() for r in self.fp8],
        }

    def to_json(self, path: str | pathlib.Path) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        pathlib.Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self) -> Any:
        """A rich Table of the modules, worst first in each column's colour."""
        return diagnostic_table(self)

    def summary(self) -> str:
        """What to do, in a few lines."""
        lines = [str(self.first_nonfinite) if self.first_nonfinite else f"no NaN or Inf in {short_name(self.dtype)}"]
        if self.keep_fp32:
            fixed = {True: "they fix it", False: "they do not fix it all", None: "not checked"}[self.rules_fix_it]
            lines.append(f"keep in fp32: {', '.join(self.keep_fp32)} ({fixed}); report.policy() applies them")
        lines.append(f"suggested initial loss scale: {self.suggested_loss_scale:g}")
        if self.bf16_avoids_it is not None:
            # "it": the NaN/Inf named above, or, with none, the overflow or underflow the table shows
            trouble = "it" if self.first_nonfinite else f"{short_name(self.dtype)}'s overflow and underflow here"
            verdict = "would avoid" if self.bf16_avoids_it else "would not avoid"
            lines.append(f"bf16 {verdict} {trouble}")
        if self.fp8:
            lines.append(f"fp8 loses most in: {'; '.join(str(r) for r in self.fp8[:3])}")
        return "\n".join(lines + self.notes)

    def plot(self, path: str | pathlib.Path) -> None:
        """Per-module value ranges on a log scale against the dtype's representable range (PNG)."""
        diagnostic_plot(self, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiagnosticReport:
        """The report :meth:`to_dict` wrote (``json.loads`` of :meth:`to_json`'s file)."""
        first = data.get("first_nonfinite")
        return cls(
            dtype=parse_dtype(data["dtype"], what="report dtype"),
            modules=[ModuleReport.from_dict(m) for m in data["modules"]],
            first_nonfinite=None if first is None else NonFinite(**first),
            keep_fp32=list(data["keep_fp32"]),
            rules_fix_it=data["rules_fix_it"],
            suggested_loss_scale=data["suggested_loss_scale"],
            bf16_avoids_it=data["bf16_avoids_it"],
            notes=list(data["notes"]),
            loss=data["loss"],
            loss_fp32=data["loss_fp32"],
            fp8=[Fp8LayerReport.from_dict(r) for r in data.get("fp8", [])],
        )


# ----- drawing ---------------------------------------------------------------------------------------------


def diagnostic_table(report: DiagnosticReport) -> Any:
    """A rich Table of the modules, worst first in each column's colour."""
    from rich.table import Table

    dt = short_name(report.dtype)
    table = Table(
        title=f"mixprec diagnose ({dt}): "
        + (str(report.first_nonfinite) if report.first_nonfinite else "no NaN or Inf")
    )
    for column in (
        "module",
        "type",
        "act absmax",
        "act overflow",
        "act underflow",
        "grad absmax",
        "grad underflow",
        f"{dt} nan/inf",
        "rel err vs fp32",
    ):
        table.add_column(column, justify="left" if column in ("module", "type") else "right")
    for m in report.modules:
        bad = m.nan + m.inf
        style = "red" if (bad or m.activations.overflow) else ("yellow" if m.name in report.keep_fp32 else None)
        table.add_row(
            m.name or "<model>",
            m.type,
            f"{m.activations.absmax:.3g}",
            f"{m.activations.overflow_frac:.2%}",
            f"{m.activations.underflow_frac:.2%}",
            f"{m.gradients.absmax:.3g}",
            f"{m.gradients.underflow_frac:.2%}",
            str(bad),
            "" if m.rel_error is None else f"{m.rel_error:.2e}",
            style=style,
        )
    return table


def diagnostic_plot(report: DiagnosticReport, path: str | pathlib.Path) -> None:
    """Per-module value ranges on a log scale against the dtype's representable range (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finfo = torch.finfo(report.dtype)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(report.modules) + 2), 7), sharex=True)
    names = [m.name or "<model>" for m in report.modules]
    xs = range(len(names))
    for ax, key, title in ((axes[0], "activations", "activations"), (axes[1], "gradients", "gradients")):
        lows, highs = [], []
        for m in report.modules:
            stats: TensorStats = getattr(m, key)
            lows.append(stats.min_nonzero if math.isfinite(stats.min_nonzero) else math.nan)
            highs.append(stats.absmax if stats.absmax > 0 else math.nan)
        ax.vlines(xs, lows, highs, linewidth=6, color="tab:blue", alpha=0.7, label="|values|, min to max")
        ax.axhline(finfo.max, color="red", linestyle="--", label=f"{short_name(report.dtype)} max {finfo.max:.3g}")
        ax.axhline(finfo.tiny, color="orange", linestyle="--", label=f"smallest normal {finfo.tiny:.3g}")
        ax.axhline(finfo.smallest_normal * finfo.eps, color="gray", linestyle=":", label="smallest subnormal")
        ax.set_yscale("log")
        ax.set_title(f"{title} per module (fp32 run, against {short_name(report.dtype)}'s range)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[1].set_xticks(list(xs), names, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
