"""How a recipe and its per-layer plan print: the candidates' table, the per-layer table, progress lines.

The recipe itself is plain data (``recipe``); this module draws it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from mixprec._src.dtypes import short_name
from mixprec._src.layers.choice import LayerChoice
from mixprec._src.layers.precision import PRECISIONS
from mixprec._src.tune.measurement import Measurement


class Recipe(Protocol):
    """What a recipe's table reads of :class:`mixprec.Recipe` (which prints itself with this module)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def measurements(self) -> tuple[Measurement, ...]: ...
    @property
    def notes(self) -> tuple[str, ...]: ...
    @property
    def layers(self) -> tuple[LayerChoice, ...]: ...
    @property
    def is_torch_default(self) -> bool: ...


__all__ = ["layer_table", "line", "recipe_table"]


def recipe_table(recipe: Recipe) -> str:
    """The candidates as a text table: speed against torch.amp's default, error against fp32, why rejected."""
    header = ("candidate", "status", "ms/step", "vs torch.amp", "loss err", "grad cos", "update cos", "reason")
    rows = [header]
    for m in recipe.measurements:
        speed = (_fmt(m.step_ms, ".1f"), _fmt(m.vs_default, ".2f", "x") + _noise(m.noise))
        error = (_fmt(m.loss_err, ".2%"), _fmt(m.grad_cos, ".5f"), _fmt(m.update_cos, ".4f"))
        rows.append((m.name, m.status, *speed, *error, m.reason))
    lines = _text_table(rows)
    tail = [f"recipe: {recipe.name}" + _default_label(recipe)]
    tail += [f"note: {n}" for n in recipe.notes]
    layers = ["", "per-layer plan:", layer_table(recipe.layers)] if recipe.layers else []
    return "\n".join([*lines, *tail, *layers])


def _default_label(recipe: Recipe) -> str:
    """Whether the recipe is the table's torch.amp baseline (the candidate measured at 1.00x of itself), or
    plain torch.autocast at another dtype: a plain fp16 recipe is not torch.amp's default where bf16 is."""
    if not recipe.is_torch_default:
        return ""
    baseline = next((m.name for m in recipe.measurements if m.vs_default == 1.0), None)
    if baseline in (None, recipe.name):
        return " (torch.amp's default)"
    return f" (plain torch.autocast in {short_name(recipe.dtype)}; the table's torch.amp baseline is {baseline})"


_SHORT = {
    "fp8-tensorwise": "fp8-tw",
    "fp8-rowwise": "fp8-rw",
    "fp8-rowwise_with_gw_hp": "fp8-rw-gw",
    "fp8-delayed": "fp8-dl",
}


def layer_table(layers: Sequence[LayerChoice], width: int | None = None) -> str:
    """A per-layer plan as a text table that fits ``width`` columns (default: the terminal's).

    One row a layer: its name, its choice and, per precision, ``ms/dB`` (forward and backward of the
    layer at its shapes / SQNR against fp32); under it, indented and wrapped, its shape and the
    reason. Long names are shortened in the middle; the full data is in ``Recipe.to_json()``.
    """
    import shutil
    import textwrap

    width = width if width is not None else shutil.get_terminal_size((100, 24)).columns
    precisions = [p for p in PRECISIONS if any(c.ms_of(p) is not None or c.sqnr_of(p) is not None for c in layers)]
    short = [_SHORT.get(p, p) for p in precisions]
    cells = [[_ms_db(c.ms_of(p), c.sqnr_of(p)) for p in precisions] for c in layers]
    choices = [_SHORT.get(c.choice, c.choice) for c in layers]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(short)]
    choice_w = max(len("choice"), *(len(ch) for ch in choices))
    fixed = choice_w + sum(w + 2 for w in widths) + 2
    name_w = max(len("layer"), min(max(len(c.name) for c in layers), max(width - fixed, 12)))
    legend = "ms/dB per precision: forward+backward of the layer at its shapes / SQNR against fp32"
    legend += "".join(f"; {b} = {a}" for a, b in zip(precisions, short, strict=True) if a != b)
    columns = (h.rjust(w) for h, w in zip(short, widths, strict=True))
    header = "  ".join(["layer".ljust(name_w), "choice".ljust(choice_w), *columns])
    lines = textwrap.wrap(legend, width, subsequent_indent="  ")
    lines += [header.rstrip(), "-" * min(len(header), width)]
    for c, choice, row in zip(layers, choices, cells, strict=True):
        lines.append(
            "  ".join(
                [
                    _middle(c.name, name_w).ljust(name_w),
                    choice.ljust(choice_w),
                    *(v.rjust(w) for v, w in zip(row, widths, strict=True)),
                ]
            ).rstrip()
        )
        detail = f"{c.shape}: {c.reason}" if c.reason else c.shape
        lines += textwrap.wrap(detail, width, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def _ms_db(ms: float | None, db: float | None) -> str:
    if ms is None and db is None:
        return "-"
    text = _fmt(ms, ".3f")
    return text if db is None else f"{text}/{db:.0f}" if math.isfinite(db) else f"{text}/{db}"


def _middle(name: str, width: int) -> str:
    """``name`` shortened to ``width``: its dotted parts from the left cut to their first letter (indices and the
    last part kept: ``b.e.layer.0.attention.self.query``), then, if still too long, cut in the middle."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if len(".".join(parts)) <= width:
            break
        if not parts[i].isdigit():
            parts[i] = parts[i][:1]
    short = ".".join(parts)
    if len(short) <= width:
        return short
    tail = (width - 1) * 2 // 3
    return short[: width - 1 - tail] + "…" + short[-tail:]


def _text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell, the last (a sentence) left ragged; a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def line(m: Measurement) -> str:
    """One candidate's outcome, for progress output."""
    speed = (
        f"{m.step_ms:.1f} ms/step, {_fmt(m.vs_default, '.2f', 'x')}{_noise(m.noise)} torch.amp"
        if m.step_ms is not None
        else "-"
    )
    return f"{m.status}, {speed}" + (f": {m.reason}" if m.reason else "")


def _noise(noise: float | None) -> str:
    """`` ±3%``: how much a speed moved between repetitions (nothing where it was not measured)."""
    return "" if noise is None else f" ±{noise:.0%}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"
