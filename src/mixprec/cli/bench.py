"""``mixprec bench``: train the bench workloads in each mode, print the table, write the report."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.bench.modes import BLOCK_EMULATED, FP8_EMULATED, MODES
from mixprec.bench.runner import COMPILE_MODES, DEFAULT_MODES
from mixprec.bench.workloads import WORKLOADS
from mixprec.cli import common

__all__ = ["run"]


#: inductor's hint on CUDA where fp32 matmuls leave TF32 off: every compiled fp32 recipe of a bench prints it, and the
#: bench compares precisions as the user set them (it turns nothing on)
_TF32_HINT = "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"


def run(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message=_TF32_HINT, category=UserWarning)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from mixprec.bench import report as report_module
    from mixprec.bench.devices import resolve_device, resolve_dtype
    from mixprec.bench.runner import BenchConfig, BenchInterrupted, ModeResult, run

    size = args.size or ("quick" if args.quick else "default")
    if args.step_cost and args.llama:
        return common.refuse("--step-cost and --llama are two tables: ask for one at a time")
    if args.batch is not None and not args.llama:
        return common.refuse("--batch sets the batch of --llama; add --llama")
    if args.step_cost:
        return run_step_cost(args, size)
    if args.llama:
        return run_llama(args, size)
    if args.recipes is not None:
        return common.refuse("--recipes chooses the rows of --step-cost or --llama; add one of them")
    if args.nproc is not None:
        return run_sharded(args, size)
    compile_ = args.compile or args.compile_modes is not None
    modes, compile_modes = compile_choice(args.modes, args.compile_modes, compile_)
    try:
        config = BenchConfig(
            workloads=args.workloads,
            modes=modes,
            steps=args.steps,
            device=args.device,
            dtype=args.dtype,
            size=size,
            compile=compile_,
            compile_modes=compile_modes,
            count_fp8_kernels=compile_ and args.fp8_kernels,
            tune_budget_s=args.tune_budget,
        )
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
    except ValueError as exc:
        return common.refuse(str(exc))
    problem = common.check_outputs(args.out, args.json)
    if problem:
        return common.refuse(problem)
    console = Console(stderr=False, quiet=False)
    runs = [(w, m) for w in config.workloads for m in config.modes if MODES[m].trains(WORKLOADS[w].conv)]
    if config.compile:
        runs += [(w, m) for w, m in runs if m in (config.compile_modes or config.modes)]
    if dtype is torch.float16 and device.type == "cpu":
        print(
            "mixprec bench: warning: fp16 has no fast path on most CPUs (it is emulated, often 10-100x slower "
            "than fp32); use --dtype bf16 (or auto) on a CPU",
            file=sys.stderr,
            flush=True,
        )
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    header = f"mixprec bench: {len(runs)} runs of {config.total_steps} steps, size {size}, {device.type}, {short}"
    print(header, flush=True)

    def line(workload: str, mode: str, r: ModeResult) -> str:
        extra = f" {r.speedup_vs_fp32:.2f}x fp32" if r.speedup_vs_fp32 is not None else ""
        extra += f", {r.vs_torch_amp:.2f}x torch-amp" if r.vs_torch_amp is not None else ""
        extra += f", tuned in {r.tuning_s:.0f} s: {r.recipe}" if r.tuning_s is not None else ""
        extra += f", {r.vs_eager:.2f}x eager" if r.vs_eager is not None else ""
        extra += f", compiled in {r.compile_s:.0f} s, {r.recompiles} recompiles" if r.compiled else ""
        return f"{workload:13} {mode:13} {r.steps_per_s:8.2f} steps/s{extra}, final loss {r.final_loss:.4f}"

    def on_workload(so_far: Any) -> None:  # each finished workload written at once: a later failure loses nothing
        if so_far.results:
            report_module.write(so_far, args.out, args.json)

    try:
        if args.quiet or not sys.stdout.isatty():  # progress bars are for a terminal, not a log
            report = run(config, on_result=lambda w, m, r: print(line(w, m, r), flush=True), on_workload=on_workload)
        else:
            columns = (TextColumn("{task.description:28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=True) as progress:
                overall = progress.add_task("all runs", total=len(runs))
                current = progress.add_task("", total=config.total_steps)

                def on_step(workload: str, mode: str, done: int, total: int) -> None:
                    progress.update(current, description=f"{workload}: step, all modes", completed=done, total=total)

                def on_result(workload: str, mode: str, r: ModeResult) -> None:
                    progress.console.print(line(workload, mode, r), soft_wrap=True)
                    progress.advance(overall)

                report = run(config, progress=on_step, on_result=on_result, on_workload=on_workload)
    except BenchInterrupted as exc:
        report = exc.report
        finished = ", ".join(report.results)
        print(
            f"mixprec bench: interrupted: {len(report.results)} of {len(config.workloads)} workloads finished "
            f"({finished}); writing a partial report",
            file=sys.stderr,
            flush=True,
        )
    except KeyboardInterrupt:
        print("mixprec bench: interrupted before any workload finished; nothing written", file=sys.stderr)
        return 130
    for workload, error in report.failed.items():
        print(f"mixprec bench: workload {workload} failed: {error}", file=sys.stderr, flush=True)
    if not report.results:
        print("mixprec bench: no workload finished; nothing written", file=sys.stderr)
        return 1
    text = report_module.text_table(report)
    # A rich table squeezes cells to fit ("mixpr…", "0.24…"): plain text in logs and narrow terminals.
    n_columns = len(report_module.HEADER)
    cells = max(len(line) for line in text.splitlines()[1:]) - 2 * (n_columns - 1)
    table_width = cells + 3 * n_columns + 1  # rich: a border and a space of padding either side of each cell
    if sys.stdout.isatty() and console.width >= table_width:
        table = Table(title=report_module.title(report))
        for name in report_module.HEADER:
            table.add_column(name, justify="left" if name in ("workload", "mode") else "right")
        for row in report_module.table_rows(report):
            table.add_row(*row)
        console.print(table)
    else:
        print(text, flush=True)
    if report_module.fp8_emulated(report):
        print(FP8_EMULATED, flush=True)
    if report_module.block_emulated(report):
        print(BLOCK_EMULATED, flush=True)
    if compiled := report_module.compiled_text(report):
        print(compiled, flush=True)
    if args.memory_budget:
        print(_memory_table(args, report, config.size), flush=True)
    paths = report_module.write(report, args.out, args.json)
    if "png" not in paths:
        print(report_module.PLOT_SKIPPED.format(name="bench.png"), file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths.values()) + f" in {report.seconds:.0f} s")
    return 130 if report.interrupted else 1 if report.failed else 0  # 130: 128 + SIGINT, as a shell reports Ctrl-C


def _memory_table(args: argparse.Namespace, report: Any, size: str) -> str:
    """The memory table (bench/memory_table.py) for the modes this run trained, as Markdown."""
    from mixprec._src.tune.memory_fit import parse_bytes
    from mixprec.bench import memory_table
    from mixprec.bench.tables import markdown_table

    budget = parse_bytes(args.memory_budget)
    trained = report.results.get("transformer", {})
    losses = {mode: r.final_loss for mode, r in trained.items() if not r.compiled}
    modes = list(dict.fromkeys(["fp32", *(args.modes or trained or ())]))
    rows = memory_table.rows(modes, size, budget, losses)
    title = (
        f"Memory: the bench transformer ({size}), per rank, from mixprec.memory_plan; the largest in "
        f"{budget / 2**30:.2f} GiB grows its layers"
    )
    return "\n".join([title, "", *markdown_table(memory_table.HEADER, rows)])


def run_step_cost(args: argparse.Namespace, size: str) -> int:
    """``mixprec bench --step-cost``: the step-cost table (bench/step_cost.py), as Markdown."""
    from rich.console import Console

    from mixprec.bench import step_cost
    from mixprec.bench.devices import resolve_device
    from mixprec.bench.tables import markdown_table

    cost_size = "default" if size == "default" else "tiny"
    chosen, problem = _chosen(args.recipes, [r.name for r in step_cost.RECIPES], ["torch-amp"])
    if problem:
        return common.refuse(problem)
    recipes = tuple(r for r in step_cost.RECIPES if chosen is None or r.name in chosen)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        return common.refuse(str(exc))
    print(
        f"mixprec bench --step-cost: {len(recipes)} recipes x {len(step_cost.OPTIMIZERS)} optimizers, size "
        f"{cost_size}, {device.type}, torch {torch.__version__}",
        flush=True,
    )
    console = Console(stderr=True)
    steps = args.steps or 20
    printed: list[step_cost.Row] = []

    def finished(rows: list[step_cost.Row]) -> None:  # each optimizer form's rows as they are measured
        lines = markdown_table(step_cost.HEADER, step_cost.table_rows(rows))
        print("\n".join(lines if not printed else lines[2:]), flush=True)
        printed.extend(rows)

    try:
        if args.quiet or not sys.stderr.isatty():
            step_cost.measure(recipes, size=cost_size, steps=steps, device=device, finished=finished)
        else:
            with console.status("measuring") as status:
                step_cost.measure(
                    recipes, size=cost_size, steps=steps, device=device, progress=lambda what: status.update(what),
                    finished=finished,
                )  # fmt: skip
    except KeyboardInterrupt:
        said = "the rows above were measured" if printed else "nothing measured"
        print(f"mixprec bench: interrupted; {said}", file=sys.stderr)
        return 130
    if args.compile:
        try:
            if args.quiet or not sys.stderr.isatty():
                compiled, recompiles, eager = step_cost.measure_compiled(
                    recipes, size=cost_size, steps=steps, device=device
                )
            else:
                with console.status("compiling") as status:
                    compiled, recompiles, eager = step_cost.measure_compiled(
                        recipes, size=cost_size, steps=steps, device=device, progress=lambda what: status.update(what)
                    )
        except KeyboardInterrupt:
            print("mixprec bench: interrupted; the compiled table not measured", file=sys.stderr)
            return 130
        print(
            f"\ncompiled (torch.compile(model), inductor; fused AdamW; {recompiles} graphs compiled during the "
            f"timed steps; {eager} frames dynamo gave up on, run eagerly)",
            flush=True,
        )
        print("\n".join(markdown_table(step_cost.COMPILED_HEADER, step_cost.compiled_table_rows(compiled))), flush=True)
    return 0


def _chosen(names: str | None, known: list[str], always: Iterable[str]) -> tuple[set[str] | None, str | None]:
    """``--recipes``' names (with ``always``), or the refusal naming the unknown ones; ``None``: every recipe."""
    if names is None:
        return None, None
    chosen = {name.strip() for name in names.split(",") if name.strip()}
    unknown = sorted(chosen - set(known))
    if unknown or not chosen:
        return None, f"--recipes: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}"
    return chosen | set(always), None


def run_llama(args: argparse.Namespace, size: str) -> int:
    """``mixprec bench --llama``: a config-built Llama at each level (bench/llama.py); each row printed as measured."""
    from rich.console import Console

    from mixprec.bench import llama
    from mixprec.bench.devices import resolve_device
    from mixprec.bench.tables import markdown_table

    known = [r.name for r in llama.RECIPES]
    chosen, problem = _chosen(args.recipes, known, ["torch-amp"])
    if problem:
        return common.refuse(problem)
    recipes = llama.RECIPES
    if chosen is not None:  # the baselines a ratio needs first, then the recipes in the order asked (a time limit
        by_name = {r.name: r for r in llama.RECIPES}  # cuts the last)
        asked = [name for name in dict.fromkeys(n.strip() for n in args.recipes.split(",")) if name in by_name]
        baselines = [r.name for r in llama.RECIPES if r.name in {by_name[n].baseline for n in chosen} | {"torch-amp"}]
        recipes = tuple(by_name[n] for n in dict.fromkeys([*baselines, *asked]))
    if args.batch is not None and args.batch < 1:
        return common.refuse(f"--batch must be at least 1, not {args.batch}")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        return common.refuse(str(exc))
    shape = llama.SIZES[size]
    print(
        f"mixprec bench --llama: {len(recipes)} recipes{' eager and compiled' if args.compile else ''}, size {size} "
        f"({shape.parameters() / 1e6:,.1f}M parameters, sequence {shape.seq}), {device.type}, "
        f"torch {torch.__version__}, fused AdamW",
        flush=True,
    )
    if device.type == "cpu" and any(r.fp8 for r in recipes):
        print("fp8 GEMMs are emulated in fp32 on a CPU (torch._scaled_mm): the fp8 row says nothing of fp8's speed")
    quiet = args.quiet or not sys.stderr.isatty()
    header = iter(markdown_table(llama.HEADER, []))
    try:
        with contextlib.nullcontext() if quiet else Console(stderr=True).status("building the model") as status:
            for row in llama.measure(
                recipes,
                size=size,
                steps=args.steps or 5,
                device=device,
                batch=args.batch,
                compiled=args.compile,
                progress=None if status is None else status.update,
            ):
                for line in header:  # once, above the first row
                    print(line, flush=True)
                print(markdown_table(llama.HEADER, [llama.table_row(row)])[-1], flush=True)
    except KeyboardInterrupt:
        print("mixprec bench: interrupted; the rows above were measured", file=sys.stderr)
        return 130
    except ValueError as exc:
        return common.refuse(str(exc))
    return 0


def run_sharded(args: argparse.Namespace, size: str) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mixprec.bench import sharded

    workloads = args.workloads if args.workloads != tuple(WORKLOADS) else ("transformer",)
    modes = sharded.SHARDED_MODES
    explicit = [m for m in args.modes or () if m in sharded.SHARDED_MODES]
    if args.modes is not None and args.modes != DEFAULT_MODES and explicit:
        modes = tuple(explicit)
    try:
        config = sharded.ShardedConfig(
            nproc=args.nproc,
            workloads=workloads,
            modes=modes,
            size=size,
            steps=args.steps,
            device=args.device,
            dtype="bf16" if args.dtype == "auto" else args.dtype,
        )
    except ValueError as exc:
        return common.refuse(str(exc))
    problem = common.check_outputs(args.out, args.json)
    if problem:
        return common.refuse(problem)
    print(
        f"mixprec bench: {len(workloads)} workload(s) x {len(modes)} modes, FSDP2 over {args.nproc} processes "
        f"and then 1, {config.total_steps} steps, size {size}, {config.dtype}",
        flush=True,
    )
    try:
        if args.quiet or not sys.stdout.isatty():
            report = sharded.run(config)
        else:
            columns = (TextColumn("{task.description:36}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=Console(), transient=True) as progress:
                task = progress.add_task("starting processes", total=config.total_steps)

                def on_step(ranks: str, name: str, done: int, total: int) -> None:
                    progress.update(task, description=f"{ranks}: {name}", completed=done, total=total)

                report = sharded.run(config, progress=on_step)
    except KeyboardInterrupt:
        print("mixprec bench: interrupted; nothing written", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"mixprec bench: {exc}", file=sys.stderr)
        return 2
    print(sharded.text_table(report), flush=True)
    paths = sharded.write(report, args.out)
    if args.json:
        import json
        import pathlib

        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        paths.append(pathlib.Path(args.json))
    print("wrote " + ", ".join(str(p) for p in paths) + f" in {report['seconds']:.0f} s")
    return 0


def compile_choice(
    modes: tuple[str, ...] | None, compile_modes: tuple[str, ...] | None, compile_: bool
) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """The bench's modes and compiled modes from --modes, --compile-modes and --compile (see --compile's help)."""
    if compile_modes is not None:  # each compiled mode also trains eagerly
        base = modes if modes is not None else ("fp32",)
        return (*base, *(m for m in compile_modes if m not in base)), compile_modes
    if modes is not None:
        return modes, None  # every mode, compiled too (with --compile)
    if compile_:
        return ("fp32", *COMPILE_MODES), COMPILE_MODES
    return DEFAULT_MODES, None
