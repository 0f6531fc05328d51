"""How diagnose's report is shown: a rich table of the modules and a matplotlib plot of their ranges.

The report itself is plain data (``report``); this module draws it. A recipe's tables are
``tune.tables``'.
"""

from __future__ import annotations

import math
import pathlib
from typing import TYPE_CHECKING, Any

import torch

from mixprec._src.dtypes import short_name

if TYPE_CHECKING:  # types only: the report imports this module to draw itself
    from mixprec._src.observe.report import DiagnosticReport, TensorStats

__all__ = ["diagnostic_plot", "diagnostic_table"]


def diagnostic_table(report: DiagnosticReport) -> Any:
    """A rich Table of the modules, worst first in each column's colour."""
    from rich.table import Table

    dt = short_name(report.dtype)
    table = Table(title=f"mixprec diagnose ({dt}): " + (str(report.first_nonfinite) if report.first_nonfinite
                                                         else "no NaN or Inf"))  # fmt: skip
    for column in ("module", "type", "act absmax", "act overflow", "act underflow", "grad absmax",
                   "grad underflow", f"{dt} nan/inf", "rel err vs fp32"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("module", "type") else "right")
    for m in report.modules:
        bad = m.nan + m.inf
        style = "red" if (bad or m.activations.overflow) else ("yellow" if m.name in report.keep_fp32 else None)
        table.add_row(
            m.name or "<model>", m.type, f"{m.activations.absmax:.3g}", f"{m.activations.overflow_frac:.2%}",
            f"{m.activations.underflow_frac:.2%}", f"{m.gradients.absmax:.3g}",
            f"{m.gradients.underflow_frac:.2%}", str(bad),
            "" if m.rel_error is None else f"{m.rel_error:.2e}", style=style,
        )  # fmt: skip
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
