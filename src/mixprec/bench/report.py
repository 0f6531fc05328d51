"""Write a :class:`~mixprec.bench.BenchReport` as ``report.json``, ``report.md`` and ``bench.png``."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from mixprec.bench.runner import BenchReport


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.2f}%"


def table_rows(report: BenchReport) -> list[list[str]]:
    """Rows of the results table (also used by the CLI), one per workload and mode."""
    rows = []
    for workload, modes in report.results.items():
        for mode, r in modes.items():
            rows.append([workload, mode, f"{r.steps_per_s:.2f}", _ratio(r.speedup_vs_fp32), _ratio(r.vs_torch_amp),
                         _mb(r.peak_mem_bytes), _mb(r.state_bytes), f"{r.final_loss:.4f}",
                         _pct(r.loss_rel_diff_vs_fp32)])  # fmt: skip
    return rows


HEADER = ["workload", "mode", "steps/s", "vs fp32", "vs torch-amp", "peak mem", "state", "final loss", "loss vs fp32"]


def markdown(report: BenchReport) -> str:
    """The Markdown report: settings, the results table, and how each figure was measured."""
    cfg = report.config
    lines = [
        "# mixprec bench",
        "",
        f"Device: {report.device} ({report.device_name}); dtype: {report.dtype}; torch {report.torch_version}; "
        f"mixprec {report.mixprec_version}. Size: {cfg.size}; {cfg.total_steps} steps per run "
        f"({cfg.warmup} warm-up); took {report.seconds:.0f} s.",
        "",
    ]
    if report.interrupted:
        done = len(report.results)
        lines += [f"**Interrupted** (Ctrl-C): {done} of {len(cfg.workloads)} workloads finished; only they are shown.",
                  ""]  # fmt: skip
    lines += [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    lines += [
        "",
        "steps/s: median over timed windows after warm-up. vs fp32, vs torch-amp: ratios of steps/s from "
        "this run. Peak mem: CUDA max allocated, or on CPU the peak resident set above the level before the "
        "run (indicative). State: exact bytes of parameters, gradients, fp32 masters and optimizer state. "
        "Final loss: mean of the last steps; loss vs fp32: its relative difference after the same steps. "
        "Image outputs (the checkerboard) are shown after this run's steps; the reference trains 500 to draw "
        "the board.",
        "",
        "![bench](bench.png)",
        "",
    ]
    return "\n".join(lines)


PLOT_SKIPPED = "{name} skipped: matplotlib is not installed (pip install matplotlib, or 'mixprec[bench]')"


def plot(report: BenchReport, path: pathlib.Path) -> None:
    """Loss curves per workload, throughput bars, and image outputs beside their targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report.results)
    image_workloads = [w for w in workloads if w in report.images]
    columns = max(2, len(workloads))
    rows = 2 + (1 if image_workloads else 0)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=False):
        for mode, r in report.results[workload].items():
            ax.plot(range(1, len(r.losses) + 1), r.losses, label=mode, linewidth=1.4)
        ax.set_title(f"{workload}: training loss")
        ax.set_xlabel("step")
        values = [v for r in report.results[workload].values() for v in r.losses]
        if min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    for ax in axes[0][len(workloads) :]:
        ax.axis("off")
    bars = plt.subplot2grid((rows, columns), (1, 0), colspan=columns, fig=fig)
    for ax in axes[1]:
        ax.remove()
    modes: list[str] = []
    for by_mode in report.results.values():
        modes += [m for m in by_mode if m not in modes]
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + i * width for j, w in enumerate(workloads) if mode in report.results[w]]
        ys = [report.results[w][mode].speedup_vs_fp32 or math.nan for w in workloads if mode in report.results[w]]
        bars.bar(xs, ys, width, label=mode)
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(workloads))], workloads)
    bars.set_ylabel("speed-up over fp32 (steps/s)")
    bars.set_title(f"throughput, {report.dtype} on {report.device}")
    bars.legend(fontsize=8)
    if image_workloads:
        panels = []
        for workload in image_workloads:
            images = report.images[workload]
            shown = [m for m in images if m.startswith("mixprec")] or [m for m in images if m != "target"]
            best = max(shown, key=lambda m: report.results[workload][m].steps_per_s)
            panels += [(f"{workload}: {best} output", images[best]), (f"{workload}: target", images["target"])]
        for ax, (title, image) in zip(axes[2], panels, strict=False):
            ax.imshow(image.numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_title(title)
            ax.axis("off")
        for ax in axes[2][len(panels) :]:
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(
    report: BenchReport, out_dir: str | pathlib.Path, json_path: str | pathlib.Path | None = None
) -> dict[str, Any]:
    """Write report.json, report.md and bench.png into ``out_dir`` (and JSON to ``json_path``); returns the paths.

    Without matplotlib there is no bench.png, and no ``"png"`` among the paths returned.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report.to_dict(), indent=2)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "png": out / "bench.png"}
    paths["json"].write_text(data + "\n")
    if json_path is not None:
        extra = pathlib.Path(json_path)
        extra.parent.mkdir(parents=True, exist_ok=True)
        extra.write_text(data + "\n")
    paths["markdown"].write_text(markdown(report))
    try:
        plot(report, paths["png"])
    except ModuleNotFoundError as exc:  # matplotlib is optional (the [bench] extra)
        if exc.name != "matplotlib":
            raise
        del paths["png"]
        paths["markdown"].write_text(markdown(report).replace("![bench](bench.png)\n", ""))
    if json_path is not None:
        paths["extra_json"] = extra
    return paths
