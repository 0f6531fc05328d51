"""The ``mixprec`` command: ``mixprec bench``, ``mixprec diagnose``, ``mixprec tune`` and ``mixprec policy``."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import torch

from mixprec.bench.modes import MODES
from mixprec.bench.runner import COMPILE_MODES, DEFAULT_MODES
from mixprec.bench.workloads import SIZES, WORKLOADS


def _names(text: str, valid: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        shown = ", ".join(repr(n) for n in unknown) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown {what} {shown}; valid: {', '.join(valid)}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixprec", description="Mixed-precision training tools for PyTorch.")
    from mixprec import __version__

    parser.add_argument("--version", action="version", version=f"mixprec {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="train each workload in fp32, torch.amp and mixprec modes side by side",
        description="Train each workload in each mode on this machine and report steps/s, speed-ups, peak "
        "memory and final loss; writes report.json, report.md and bench.png.",
    )
    bench.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="smaller workloads and fewer steps (about a minute)",
    )
    bench.add_argument("--steps", type=int, help="training steps per run (default: by size)")
    bench.add_argument(
        "--workloads",
        type=lambda t: _names(t, list(WORKLOADS), "workload"),
        default=tuple(WORKLOADS),
        help=f"comma-separated; default all: {','.join(WORKLOADS)}",
    )
    bench.add_argument("--modes", type=lambda t: _names(t, list(MODES), "mode"),
                       help=f"comma-separated; default {','.join(DEFAULT_MODES)} (with --compile: fp32 and "
                       f"{','.join(COMPILE_MODES)}); available: {','.join(MODES)}")  # fmt: skip
    bench.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    bench.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16"],
                       help="auto: bf16 where it is fast, else fp16 on CUDA; fp16 runs use a GradScaler")  # fmt: skip
    bench.add_argument("--size", choices=SIZES, help="workload size (overrides --quick)")
    bench.add_argument("--tune-budget", type=float, default=60.0,
                       help="seconds mixprec.tune may take per workload for mixprec-tuned (default 60)")  # fmt: skip
    bench.add_argument("--out", default="mixprec-bench", help="output folder (default ./mixprec-bench/)")
    bench.add_argument("--json", help="also write the JSON report here")
    bench.add_argument(
        "--quiet",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no progress bars: one log line per result (so too when stdout is not a terminal)",
    )
    bench.add_argument(
        "--nproc",
        type=int,
        help="train under FSDP2 (fully_shard) over N processes on this machine, each prepare level beside torch's "
        "own FSDP2 mixed precision and one process (gloo on CPU, NCCL on CUDA); default workload: transformer",
    )
    bench.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also train modes as torch.compile(model) and report them against eager and against compiled "
        f"torch-amp: every mode of --modes, or without --modes fp32 eager and {','.join(COMPILE_MODES)} "
        "eager and compiled; also counts inductor's kernels per fp8 linear against torchao's (compiling takes "
        "minutes on a CPU)",
    )
    bench.add_argument("--compile-modes", type=lambda t: _names(t, list(MODES), "mode"),
                       help="the modes to compile (implies --compile; each also trains eagerly)")  # fmt: skip
    bench.add_argument("--fp8-kernels", action=argparse.BooleanOptionalAction, default=True,
                       help="with --compile: count inductor's kernels per fp8 linear, mixprec against torchao "
                       "(default on)")  # fmt: skip

    diagnose = sub.add_parser(
        "diagnose",
        help="find where low precision breaks a model (overflow, underflow, NaN), and what to do",
        description="Run a model forward and backward in fp32 and in fp16/bf16, and report per module the "
        "value ranges against the dtype, NaN/Inf, the first non-finite op, modules to keep in fp32 and a loss scale.",
    )
    _add_target_arguments(diagnose, "a bench workload (tiny size)", ", as diagnose(targets=)")
    diagnose.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    diagnose.add_argument("--policy", help="the autocast policy to check, e.g. cpu, cuda, 'compute=fp16,keep=norm'")
    diagnose.add_argument("--fp8", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"],
                          help="also report per fp8 layer its SQNR, saturation and flush-to-zero")  # fmt: skip
    diagnose.add_argument("--out", default="mixprec-diagnose", help="folder for report.json and diagnose.png")

    tune = sub.add_parser(
        "tune",
        help="find the fastest precision recipe for a model that keeps its accuracy, measured here",
        description="Time candidate recipes (dtype, ops moved to fp32, memory layout, prepare level) on the model "
        "and batch, keep those whose first steps stay within tolerance of fp32, plan each linear and "
        "convolution's precision, and print the tables; --out writes the recipe as JSON for "
        "mixprec.Recipe.from_json.",
    )
    _add_target_arguments(tune, "a bench workload", "")
    tune.add_argument("--size", choices=SIZES, default="default", help="--workload's size (default: default)")
    tune.add_argument("--budget", type=float, default=60.0, help="seconds the search may take (default 60)")
    tune.add_argument("--dtypes", default="bf16,fp16,fp32", help="compute dtypes to search (default bf16,fp16,fp32)")
    tune.add_argument("--levels", default="O2,bf16-sr", help="prepare levels to search besides O1 (default O2,bf16-sr)")
    tune.add_argument("--no-per-layer", dest="per_layer", action="store_false",
                      help="no per-layer plan (each layer timed and checked in each precision)")  # fmt: skip
    tune.add_argument("--layer-sqnr-db", type=float, default=20.0,
                      help="a layer's SQNR floor against fp32 for the per-layer plan (default 20)")  # fmt: skip
    tune.add_argument("--out", help="write the recipe here as JSON")

    policy = sub.add_parser("policy", help="print a precision policy's op lists")
    policy.add_argument(
        "spec", nargs="?", default="cpu", help="a policy name or string, e.g. cpu, cuda, 'compute=bf16'"
    )
    return parser


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from mixprec.bench import report as report_module
    from mixprec.bench.runner import BenchConfig, BenchInterrupted, ModeResult, resolve_device, resolve_dtype, run

    size = args.size or ("quick" if args.quick else "default")
    if args.nproc is not None:
        return _bench_sharded(args, size)
    compile_ = args.compile or args.compile_modes is not None
    modes, compile_modes = _compile_choice(args.modes, args.compile_modes, compile_)
    try:
        config = BenchConfig(workloads=args.workloads, modes=modes, steps=args.steps, device=args.device,
                             dtype=args.dtype, size=size, compile=compile_, compile_modes=compile_modes,
                             count_fp8_kernels=compile_ and args.fp8_kernels,
                             tune_budget_s=args.tune_budget)  # fmt: skip
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
    except ValueError as exc:
        return _refuse(str(exc))
    problem = _check_outputs(args.out, args.json)
    if problem:
        return _refuse(problem)
    console = Console(stderr=False, quiet=False)
    runs = [(w, m) for w in config.workloads for m in config.modes if MODES[m].trains(WORKLOADS[w].conv)]
    if config.compile:
        runs += [(w, m) for w, m in runs if m in (config.compile_modes or config.modes)]
    if dtype is torch.float16 and device.type == "cpu":
        print("mixprec bench: warning: fp16 has no fast path on most CPUs (it is emulated, often 10-100x slower "
              "than fp32); use --dtype bf16 (or auto) on a CPU", file=sys.stderr, flush=True)  # fmt: skip
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

    try:
        if args.quiet or not sys.stdout.isatty():  # progress bars are for a terminal, not a log
            report = run(config, on_result=lambda w, m, r: print(line(w, m, r), flush=True))
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

                report = run(config, progress=on_step, on_result=on_result)
    except BenchInterrupted as exc:
        report = exc.report
        finished = ", ".join(report.results)
        print(f"mixprec bench: interrupted: {len(report.results)} of {len(config.workloads)} workloads finished "
              f"({finished}); writing a partial report", file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print("mixprec bench: interrupted before any workload finished; nothing written", file=sys.stderr)
        return 130
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
        print(report_module.FP8_EMULATED, flush=True)
    if compiled := report_module.compiled_text(report):
        print(compiled, flush=True)
    paths = report_module.write(report, args.out, args.json)
    if "png" not in paths:
        print(report_module.PLOT_SKIPPED.format(name="bench.png"), file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths.values()) + f" in {report.seconds:.0f} s")
    return 130 if report.interrupted else 0  # 128 + SIGINT, as a shell reports a Ctrl-C


def _bench_sharded(args: argparse.Namespace, size: str) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mixprec.bench import sharded

    workloads = args.workloads if args.workloads != tuple(WORKLOADS) else ("transformer",)
    modes = sharded.SHARDED_MODES
    explicit = [m for m in args.modes or () if m in sharded.SHARDED_MODES]
    if args.modes is not None and args.modes != DEFAULT_MODES and explicit:
        modes = tuple(explicit)
    try:
        config = sharded.ShardedConfig(nproc=args.nproc, workloads=workloads, modes=modes, size=size,
                                       steps=args.steps, device=args.device,
                                       dtype="bf16" if args.dtype == "auto" else args.dtype)  # fmt: skip
    except ValueError as exc:
        return _refuse(str(exc))
    problem = _check_outputs(args.out, args.json)
    if problem:
        return _refuse(problem)
    print(f"mixprec bench: {len(workloads)} workload(s) x {len(modes)} modes, FSDP2 over {args.nproc} processes "
          f"and then 1, {config.total_steps} steps, size {size}, {config.dtype}", flush=True)  # fmt: skip
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


def _compile_choice(modes: tuple[str, ...] | None, compile_modes: tuple[str, ...] | None,
                    compile_: bool) -> tuple[tuple[str, ...], tuple[str, ...] | None]:  # fmt: skip
    """The bench's modes and compiled modes from --modes, --compile-modes and --compile (see --compile's help)."""
    if compile_modes is not None:  # each compiled mode also trains eagerly
        base = modes if modes is not None else ("fp32",)
        return (*base, *(m for m in compile_modes if m not in base)), compile_modes
    if modes is not None:
        return modes, None  # every mode, compiled too (with --compile)
    if compile_:
        return ("fp32", *COMPILE_MODES), COMPILE_MODES
    return DEFAULT_MODES, None


def _refuse(problem: str) -> int:
    """Say why ``mixprec bench`` cannot run; the exit status of bad input."""
    print(f"mixprec bench: {problem}", file=sys.stderr)
    return 2


def _check_outputs(out: str, json_path: str | None) -> str | None:
    """Why the report could not be written to ``out`` (a folder) and ``json_path``, or None: checked
    before the run, so that a bad path costs no training."""
    import pathlib
    import tempfile

    def writable(folder: pathlib.Path) -> str | None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            return exc.strerror or str(exc)
        return None

    reason = writable(pathlib.Path(out))
    if reason:
        return f"cannot write --out {out}: {reason}; choose a folder you can write to"
    if json_path is not None:
        path = pathlib.Path(json_path)
        if path.is_dir():
            return f"--json {json_path} is a folder; give a file path, e.g. {path / 'report.json'}"
        reason = writable(path.parent)
        if reason:
            return f"cannot write --json {json_path}: {reason}; choose a file in a folder you can write to"
    return None


def _add_target_arguments(parser: argparse.ArgumentParser, workload_help: str, loss_note: str) -> None:
    """--workload, or --model with --batch and --loss: what diagnose and tune run on."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--workload", choices=list(WORKLOADS), help=workload_help)
    target.add_argument("--model", help="module:factory, a function returning the model (e.g. mypkg.models:build)")
    parser.add_argument("--batch", help="module:function returning the inputs, or (inputs, targets) with --loss")
    parser.add_argument("--loss", help=f"module:function(output, targets) -> scalar loss{loss_note}")


def _load(spec: str, what: str) -> Any:
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must be module:function, e.g. mypkg.models:build, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules in the current folder import, as under `python -m`
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r}: {exc}") from exc


def _what(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _diagnose(args: argparse.Namespace) -> int:
    import pathlib

    from rich.console import Console

    from mixprec._src.observe.diagnostics import diagnose

    try:
        targets: Any = None
        loss_fn: Any = None
        if args.workload:
            task = WORKLOADS[args.workload].build("tiny", torch.device("cpu"))
            model, (inputs, targets) = task.model, task.batch(0)

            def loss_fn(out: Any, targets: Any) -> torch.Tensor:
                return task.loss_fn(out.float(), targets)
        else:
            if not args.batch:
                raise ValueError("--model needs --batch module:function returning the model's inputs")
            model = _load(args.model, "--model")()
            if not isinstance(model, torch.nn.Module):
                raise ValueError(f"--model {args.model} returned {_what(model)}; it must return the torch.nn.Module "
                                 "to diagnose (does the function end with `return model`?)")  # fmt: skip
            batch = _load(args.batch, "--batch")()
            if batch is None:
                raise ValueError(f"--batch {args.batch} returned None; it must return the model's inputs, "
                                 "or (inputs, targets) with --loss")  # fmt: skip
            inputs = batch
            if args.loss:
                loss_fn = _load(args.loss, "--loss")
                if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                    raise ValueError(f"--batch must return (inputs, targets) when --loss is given: --loss is called "
                                     f"as loss(output, targets); {args.batch} returned {_what(batch)}")  # fmt: skip
                inputs, targets = batch
        report = diagnose(model, inputs, loss_fn, targets=targets, dtype=args.dtype, policy=args.policy, fp8=args.fp8)
    except (ValueError, TypeError) as exc:
        print(f"mixprec diagnose: {exc}", file=sys.stderr)
        return 2
    table = report.table()
    console = Console()
    if not sys.stdout.isatty():  # a log: the table at its natural width, not squeezed into 80 columns
        console = Console(width=max(console.width, Console(width=1000).measure(table).maximum))
    console.print(table)
    console.print(report.summary())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.to_json(out / "report.json")
    written = [out / "report.json"]
    try:
        report.plot(out / "diagnose.png")
        written.append(out / "diagnose.png")
    except ModuleNotFoundError as exc:  # matplotlib is optional (the [bench] extra)
        if exc.name != "matplotlib":
            raise
        from mixprec.bench.report import PLOT_SKIPPED

        print(PLOT_SKIPPED.format(name="diagnose.png"), file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _user_task(args: argparse.Namespace, command: str) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model, inputs, loss and targets named by --model/--batch/--loss."""
    if not args.batch:
        raise ValueError("--model needs --batch module:function returning the model's inputs")
    model = _load(args.model, "--model")()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {args.model} returned {_what(model)}; it must return the torch.nn.Module "
                         f"to {command} (does the function end with `return model`?)")  # fmt: skip
    batch = _load(args.batch, "--batch")()
    if batch is None:
        raise ValueError(f"--batch {args.batch} returned None; it must return the model's inputs, "
                         "or (inputs, targets) with --loss")  # fmt: skip
    if not args.loss:
        return model, batch, None, None
    loss_fn = _load(args.loss, "--loss")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"--batch must return (inputs, targets) when --loss is given: --loss is called "
                         f"as loss(output, targets); {args.batch} returned {_what(batch)}")  # fmt: skip
    return model, batch[0], loss_fn, batch[1]


def _tune(args: argparse.Namespace) -> int:
    from mixprec._src.tune.search import tune

    def say(text: str) -> None:
        print(f"mixprec tune: {text}", flush=True)

    try:
        optimizer = None
        if args.workload:
            from mixprec.bench.runner import make_optimizer, resolve_device

            device = resolve_device("auto")
            task = WORKLOADS[args.workload].build(args.size, device)
            model, (inputs, targets) = task.model.to(device), task.batch(0)
            optimizer = make_optimizer(task, model.parameters())

            def loss_fn(out: Any, targets: Any) -> torch.Tensor:
                return task.loss_fn(out.float(), targets)
        else:
            model, inputs, loss_fn, targets = _user_task(args, "tune")  # type: ignore[assignment]
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
        recipe = tune(model, inputs, loss_fn, targets=targets, optimizer=optimizer, budget_s=args.budget,
                      dtypes=dtypes, levels=levels, per_layer=args.per_layer, layer_sqnr_db=args.layer_sqnr_db,
                      progress=say)  # fmt: skip
    except (ValueError, TypeError) as exc:
        print(f"mixprec tune: {exc}", file=sys.stderr)
        return 2
    print(recipe.table())
    print(f"tuned in {recipe.tuning_s:.1f} s on {recipe.measured_on}")
    if args.out:
        recipe.to_json(args.out)
        print(f"wrote {args.out}")
    return 0


def _policy(args: argparse.Namespace) -> int:
    from mixprec._src.policy.grammar import get_policy

    try:
        policy = get_policy(args.spec)
    except ValueError as exc:
        print(f"mixprec policy: {exc}", file=sys.stderr)
        return 2
    width = max(60, min(shutil.get_terminal_size().columns, 120))
    print(repr(policy))
    print(policy.describe(width=width))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "diagnose":
            return _diagnose(args)
        if args.command == "tune":
            return _tune(args)
        return _policy(args)
    except BrokenPipeError:  # the reader went away (`mixprec policy cpu | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
