"""``mixprec diagnose``: which layer breaks in low precision, for a bench workload or the user's model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from mixprec.bench.workloads import WORKLOADS
from mixprec.cli import common

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
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
            model = common.load(args.model, "--model")()
            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    f"--model {args.model} returned {common.what(model)}; it must return the "
                    "torch.nn.Module to diagnose (does the function end with `return model`?)"
                )
            batch = common.load(args.batch, "--batch")()
            if batch is None:
                raise ValueError(
                    f"--batch {args.batch} returned None; it must return the model's inputs, "
                    "or (inputs, targets) with --loss"
                )
            inputs = batch
            if args.loss:
                loss_fn = common.load(args.loss, "--loss")
                if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                    raise ValueError(
                        "--batch must return (inputs, targets) when --loss is given: --loss is called as "
                        f"loss(output, targets); {args.batch} returned {common.what(batch)}"
                    )
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
