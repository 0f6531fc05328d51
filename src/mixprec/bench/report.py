"""Write a :class:`~mixprec.bench.BenchReport` as ``report.json``, ``report.md`` and ``bench.png``."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from mixprec.bench.modes import BLOCK_EMULATED, FP8_EMULATED, MODES
from mixprec.bench.runner import BenchReport
from mixprec.bench.tables import aligned, markdown_table


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.2f}%"


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.0f} s"


def table_rows(report: BenchReport) -> list[list[str]]:
    """Rows of the results table (also used by the CLI), one per workload and eager mode (the compiled runs
    have a table of their own, :func:`compiled_rows`)."""
    rows = []
    for workload, modes in report.results.items():
        for mode, r in modes.items():
            if r.compiled:
                continue
            rows.append(
                [
                    workload,
                    mode,
                    f"{r.steps_per_s:.2f}",
                    _ratio(r.speedup_vs_fp32),
                    _ratio(r.vs_torch_amp),
                    _mb(r.peak_mem_bytes),
                    _mb(r.state_bytes),
                    f"{r.final_loss:.4f}",
                    _pct(r.loss_rel_diff_vs_fp32),
                    _seconds(r.tuning_s),
                ]
            )
    return rows


HEADER = [
    "workload",
    "mode",
    "steps/s",
    "vs fp32",
    "vs torch-amp",
    "peak mem",
    "state",
    "final loss",
    "loss vs fp32",
    "tuning",
]
_LEFT = ("workload", "mode")

COMPILED_HEADER = [
    "workload",
    "mode",
    "eager steps/s",
    "compiled steps/s",
    "vs eager",
    "vs compiled torch-amp",
    "compile",
    "graphs",
    "graph breaks",
    "recompiles",
    "loss vs eager",
]

#: The target for compiled mixprec O1 against compiled torch.autocast.
COMPILED_TARGET = 0.97


def compiled_rows(report: BenchReport) -> list[list[str]]:
    """Rows of the compiled table, one per workload and compiled mode: its speed against the same mode's eager
    run and against compiled torch-amp, the compile time, and dynamo's graphs, breaks and recompiles."""
    rows = []
    for workload, modes in report.results.items():
        for name, r in modes.items():
            if not r.compiled:
                continue
            mode = name.removesuffix("+compile")
            eager = modes.get(mode)
            compile_s = f"{r.compile_s or 0:.1f} s" + (" (cache)" if r.inductor_cache_hits else "")
            rows.append(
                [
                    workload,
                    mode,
                    f"{eager.steps_per_s:.2f}" if eager else "",
                    f"{r.steps_per_s:.2f}",
                    _ratio(r.vs_eager),
                    _ratio(r.vs_compiled_torch_amp),
                    compile_s,
                    str(r.graphs),
                    str(r.graph_breaks),
                    str(r.recompiles),
                    _pct(r.loss_rel_diff_vs_eager),
                ]
            )
    return rows


def compiled_summary(report: BenchReport) -> list[str]:
    """Sentences under the compiled table: compiled mixprec O1 against the target, recompiles, eager frames."""
    lines = []
    for mode, what in (
        ("O1", 'prepare(level="O1")'),
        ("O1-nokeep", 'prepare(level="O1", keep_types=())'),
        ("mixprec", "mixprec.autocast"),
    ):
        ratios: dict[str, float] = {}
        for workload, modes in report.results.items():
            ratio = modes[f"{mode}+compile"].vs_compiled_torch_amp if f"{mode}+compile" in modes else None
            if ratio is not None:
                ratios[workload] = ratio
        if not ratios:
            continue
        low = min(ratios, key=lambda w: ratios[w])
        below = [w for w, r in ratios.items() if r < COMPILED_TARGET]
        verdict = (
            f"below the target of {COMPILED_TARGET:.2f}x on {', '.join(below)}"
            if below
            else (f"at or above the target of {COMPILED_TARGET:.2f}x on every workload")
        )
        lines.append(
            f"Compiled {mode} (`{what}`) against compiled torch-amp: {ratios[low]:.2f}x at the lowest "
            f"({low}), {max(ratios.values()):.2f}x at the highest; {verdict}."
        )
    compiled = [(w, m, r) for w, modes in report.results.items() for m, r in modes.items() if r.compiled]
    recompiled = [f"{w}/{m} ({r.recompiles})" for w, m, r in compiled if r.recompiles]
    lines.append("Recompiles after warm-up: " + (", ".join(recompiled) if recompiled else "none") + ".")
    eager = [f"{w}/{m} ({r.eager_frames})" for w, m, r in compiled if r.eager_frames]
    if eager:
        lines.append("Frames dynamo did not compile (they ran eagerly): " + ", ".join(eager) + ".")
    return lines


KERNELS_HEADER = [
    "variant",
    "forward kernels",
    "backward kernels",
    "kernels",
    "launches",
    "per fp8 linear",
    "launches per linear",
    "extern calls",
    "fallbacks",
    "compile",
]


def kernel_rows(kernels: dict[str, Any]) -> list[list[str]]:
    """Rows of the fp8 kernel table, one per variant (``kernels.count_fp8_kernels``'s result)."""
    rows = []
    for name, v in kernels["variants"].items():
        if "error" in v:
            rows.append([name, v["error"], *[""] * (len(KERNELS_HEADER) - 2)])
            continue
        per_graph = {g["name"]: str(g["kernels"]) for g in v["graphs"]}
        rows.append(
            [
                name,
                per_graph.get("forward", ""),
                per_graph.get("backward", ""),
                str(v["kernels"]),
                str(v["launches"]),
                f"{v['kernels_per_linear']:.2f}",
                f"{v['launches_per_linear']:.2f}",
                str(v["extern_calls"]),
                str(v["fallback_calls"]),
                _seconds(v["compile_s"]),
            ]
        )
    return rows


def compiled_markdown(report: BenchReport) -> list[str]:
    """The compiled section of the report (empty without compiled runs or kernel counts)."""
    lines: list[str] = []
    rows = compiled_rows(report)
    if rows:
        lines += [
            "## Compiled",
            "",
            "Each mode below also trained as `torch.compile(model)` of the model the mode prepared (default "
            "inductor backend), in lockstep with the eager runs.",
            "",
            *markdown_table(COMPILED_HEADER, rows),
            "",
            "vs eager: compiled steps/s over the same mode's eager steps/s. vs compiled torch-amp: over compiled "
            "torch.autocast's. Compile: the warm-up steps' time beyond as many timed steps (compiling forward and "
            "backward; the first compiled run also pays inductor's start-up; (cache): inductor loaded graphs from its "
            "on-disk cache of earlier runs). Graphs, graph breaks: what dynamo compiled during warm-up (0 graphs: the "
            "run reused a graph another mode compiled with the same guards). Recompiles: frames dynamo compiled "
            "again after warm-up, which should be 0. Loss vs eager: the final loss against the eager run's.",
            "",
            *compiled_summary(report),
            "",
        ]
    if report.fp8_kernels is not None:
        lines += kernels_markdown(report.fp8_kernels)
    return lines


def kernels_markdown(kernels: dict[str, Any]) -> list[str]:
    """The fp8 kernel section: the table, what was compiled, and where mixprec's count is higher."""
    sizes = " -> ".join(str(s) for s in kernels["sizes"])
    higher = kernels["mixprec_higher"]
    return [
        "## Kernels per fp8 linear",
        "",
        f"The code inductor generates for one forward and backward of a model of {kernels['linears']} linears "
        f"({sizes}, ReLU between them, {kernels['tokens']} tokens) on {kernels['device']}, with "
        f"`{kernels['recipe']}` fp8: mixprec's `prepare(model, opt, \"O1\", fp8=...)` against torchao's "
        "`convert_to_float8_training` on the same linears under `torch.autocast`, and O1 without fp8 for "
        "reference. Kernels: those inductor generated (Triton on CUDA, C++ on a CPU); launches: their calls; "
        "extern calls: library kernels (the GEMMs); fallbacks: ATen ops left eager.",
        "",
        *markdown_table(KERNELS_HEADER, kernel_rows(kernels)),
        "",
        *_higher(higher),
        "",
    ]


def _higher(lines: list[str]) -> list[str]:
    if not lines:
        return ["mixprec's counts are nowhere higher than torchao's."]
    return ["Where mixprec's count is higher than torchao's:", "", *(f"- {line}" for line in lines)]


def fp8_emulated(report: BenchReport) -> bool:
    """Whether fp8 modes (not block-scaled ones) ran here on a CPU."""
    ran = [MODES[m] for modes in report.results.values() for m in modes if m in MODES]
    return report.device.startswith("cpu") and any(m.fp8 and not m.block for m in ran)


def block_emulated(report: BenchReport) -> bool:
    """Whether block-scaled modes ran (emulated wherever they run)."""
    return any(MODES[m].block for modes in report.results.values() for m in modes if m in MODES)


def title(report: BenchReport) -> str:
    """The results table's title: dtype, device and torch version."""
    return f"{report.dtype} on {report.device} ({report.device_name}), torch {report.torch_version}"


def text_table(report: BenchReport) -> str:
    """The results table as aligned plain text, for logs and narrow terminals (nothing is cut)."""
    return "\n".join([title(report), *aligned(HEADER, table_rows(report))])


def compiled_text(report: BenchReport) -> str:
    """The compiled table and the fp8 kernel table as aligned plain text ("" without either)."""
    parts: list[str] = []
    if rows := compiled_rows(report):
        parts += [
            "compiled (torch.compile, inductor) against eager and against compiled torch-amp",
            *aligned(COMPILED_HEADER, rows),
            *compiled_summary(report),
        ]
    if report.fp8_kernels is not None:
        k = report.fp8_kernels
        parts += [
            *([""] if parts else []),
            f"inductor kernels, forward and backward, {k['linears']} fp8 linears ({k['recipe']}), {k['device']}",
            *aligned(KERNELS_HEADER, kernel_rows(k), ("variant",)),
            *(f"mixprec higher: {line}" for line in k["mixprec_higher"]),
        ]
    return "\n".join(parts)


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
        lines += [
            f"**Interrupted** (Ctrl-C): {done} of {len(cfg.workloads)} workloads finished; only they are shown.",
            "",
        ]
    for workload, error in report.failed.items():
        lines += [f"**{workload} failed**: {error}", ""]
    lines += markdown_table(HEADER, table_rows(report))
    lines += [
        "",
        "steps/s: median over timed windows after warm-up. vs fp32, vs torch-amp: ratios of steps/s from "
        "this run. Peak mem: CUDA max allocated, or on CPU the peak resident set above the level before the "
        "run (indicative). State: exact bytes of parameters, gradients, fp32 masters and optimizer state. "
        "Final loss: mean of the last steps; loss vs fp32: its relative difference after the same steps "
        "(bench.png plots it at every step). Tuning: the seconds mixprec.tune took on the workload before "
        "training (not counted in steps/s).",
        "",
        *([FP8_EMULATED + ".", ""] if fp8_emulated(report) else []),
        *([BLOCK_EMULATED + ".", ""] if block_emulated(report) else []),
        *_recipes(report),
        *compiled_markdown(report),
        "![bench](bench.png)",
        "",
    ]
    return "\n".join(lines)


def _recipes(report: BenchReport) -> list[str]:
    found = [(w, m, r) for w, modes in report.results.items() for m, r in modes.items() if r.recipe is not None]
    if not found:
        return []
    lines = ["Recipes chosen by mixprec.tune:", ""]
    for w, m, r in found:
        lines.append(f"- {w} ({m}): `{r.recipe}`, tuned in {r.tuning_s or 0:.0f} s")
        if r.layer_plan:
            lines += [
                "",
                "  Per-layer plan (ms: forward and both backward GEMMs at the layer's shapes):",
                "",
                *(f"      {row}" for row in r.layer_plan.splitlines()),
                "",
            ]
    return [*lines, ""]


PLOT_SKIPPED = "{name} skipped: matplotlib is not installed (pip install matplotlib, or 'mixprec[bench]')"


def plot(report: BenchReport, path: pathlib.Path) -> None:
    """Per workload, the loss curves and each mode's loss relative to fp32's; below, throughput bars.

    The modes' curves mostly lie on top of each other (that is the point of mixed precision), so
    the second row shows what differs: ``100 * (loss - fp32 loss) / |fp32 loss|`` at every step.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report.results)
    columns = max(2, len(workloads))
    rows = 3
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    modes: list[str] = []
    for by_mode in report.results.values():
        modes += [m for m in by_mode if m not in modes]
    # One colour and dash per mode in every panel; dashes keep coinciding curves visible.
    colours = {m: f"C{i}" for i, m in enumerate(modes)}
    dashes = {m: ("-", "--", ":", "-.")[i % 4] for i, m in enumerate(modes)}
    for column, workload in enumerate(workloads):
        by_mode = report.results[workload]
        ax = axes[0][column]
        for mode, r in by_mode.items():
            ax.plot(range(1, len(r.losses) + 1), r.losses, dashes[mode], color=colours[mode], label=mode, linewidth=1.4)
        ax.set_title(f"{workload}: training loss")
        ax.set_xlabel("step")
        values = [v for r in by_mode.values() for v in r.losses]
        if min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax = axes[1][column]
        ax.set_title(f"{workload}: loss vs fp32")
        reference = by_mode.get("fp32")
        if reference is None:
            ax.text(0.5, 0.5, "no fp32 run to compare with", ha="center", va="center", transform=ax.transAxes)
            ax.axis("off")
            continue
        for mode, r in by_mode.items():
            if mode == "fp32":
                continue
            rel = [100 * (a - b) / abs(b) if b else math.nan for a, b in zip(r.losses, reference.losses, strict=False)]
            ax.plot(range(1, len(rel) + 1), rel, dashes[mode], color=colours[mode], label=mode, linewidth=1.4)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("% vs fp32's loss")
        ax.legend(fontsize=8)
    for row in axes[:2]:
        for ax in row[len(workloads) :]:
            ax.axis("off")
    bars = plt.subplot2grid((rows, columns), (2, 0), colspan=columns, fig=fig)
    for ax in axes[2]:
        ax.remove()
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + i * width for j, w in enumerate(workloads) if mode in report.results[w]]
        ys = [report.results[w][mode].speedup_vs_fp32 or math.nan for w in workloads if mode in report.results[w]]
        bars.bar(xs, ys, width, label=mode, color=colours[mode])
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(workloads))], workloads)
    bars.set_ylabel("speed-up over fp32 (steps/s)")
    bars.set_title(f"throughput, {report.dtype} on {report.device}")
    bars.legend(fontsize=8)
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
