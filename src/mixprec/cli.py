"""The ``mixprec`` command: ``mixprec bench`` and ``mixprec policy``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mixprec.bench.modes import MODES
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
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="train each workload in fp32, torch.amp and mixprec modes side by side",
        description="Train each workload in each mode on this machine and report steps/s, speed-ups, peak "
        "memory and final loss; writes report.json, report.md and bench.png.",
    )
    bench.add_argument("--quick", action="store_true", help="smaller workloads and fewer steps (about a minute)")
    bench.add_argument("--steps", type=int, help="training steps per run (default: by size)")
    bench.add_argument(
        "--workloads",
        type=lambda t: _names(t, list(WORKLOADS), "workload"),
        default=tuple(WORKLOADS),
        help=f"comma-separated; default all: {','.join(WORKLOADS)}",
    )
    bench.add_argument("--modes", type=lambda t: _names(t, list(MODES), "mode"),
                       default=("fp32", "torch-amp", "mixprec", "mixprec-cl"),
                       help=f"comma-separated; available: {','.join(MODES)}")  # fmt: skip
    bench.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    bench.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16"],
                       help="auto: bf16 where it is fast, else fp16 on CUDA; fp16 runs use a GradScaler")  # fmt: skip
    bench.add_argument("--size", choices=SIZES, help="workload size (overrides --quick)")
    bench.add_argument("--out", default="mixprec-bench", help="output folder (default ./mixprec-bench/)")
    bench.add_argument("--json", help="also write the JSON report here")
    bench.add_argument("--quiet", action="store_true", help="no progress bars: one log line per result")

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
    from mixprec.bench.runner import BenchConfig, ModeResult, resolve_device, resolve_dtype, run

    size = args.size or ("quick" if args.quick else "default")
    try:
        config = BenchConfig(workloads=args.workloads, modes=args.modes, steps=args.steps, device=args.device,
                             dtype=args.dtype, size=size)  # fmt: skip
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
    except ValueError as exc:
        print(f"mixprec bench: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=False, quiet=False)
    runs = [
        (w, m) for w in config.workloads for m in config.modes if not (MODES[m].conv_only and not WORKLOADS[w].conv)
    ]
    header = f"mixprec bench: {len(runs)} runs of {config.total_steps} steps, size {size}, {device.type}, {dtype}"
    print(header, flush=True)

    def line(workload: str, mode: str, r: ModeResult) -> str:
        extra = f" {r.speedup_vs_fp32:.2f}x fp32" if r.speedup_vs_fp32 is not None else ""
        extra += f", {r.vs_torch_amp:.2f}x torch-amp" if r.vs_torch_amp is not None else ""
        return f"{workload:13} {mode:11} {r.steps_per_s:8.2f} steps/s{extra}, final loss {r.final_loss:.4f}"

    if args.quiet:
        report = run(config, on_result=lambda w, m, r: print(line(w, m, r), flush=True))
    else:
        columns = (TextColumn("{task.description:28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            overall = progress.add_task("all runs", total=len(runs))
            current = progress.add_task("", total=config.total_steps)

            def on_step(workload: str, mode: str, done: int, total: int) -> None:
                progress.update(current, description=f"{workload}: step, all modes", completed=done, total=total)

            def on_result(workload: str, mode: str, r: ModeResult) -> None:
                progress.console.print(line(workload, mode, r))
                progress.advance(overall)

            report = run(config, progress=on_step, on_result=on_result)
    table = Table(title=f"{report.dtype} on {report.device} ({report.device_name}), torch {report.torch_version}")
    for name in report_module.HEADER:
        table.add_column(name, justify="left" if name in ("workload", "mode") else "right")
    for row in report_module.table_rows(report):
        table.add_row(*row)
    console.print(table)
    paths = report_module.write(report, args.out, args.json)
    print("wrote " + ", ".join(str(p) for p in paths.values()) + f" in {report.seconds:.0f} s")
    return 0


def _policy(args: argparse.Namespace) -> int:
    from mixprec.policy import get_policy

    try:
        print(get_policy(args.spec).describe())
    except ValueError as exc:
        print(f"mixprec policy: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return _policy(args)


if __name__ == "__main__":
    sys.exit(main())
