"""``mixprec tune``: the fastest recipe that keeps accuracy, for a bench workload or the user's model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from mixprec.bench.workloads import WORKLOADS
from mixprec.cli import common

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    from mixprec._src.tune.search import tune

    def say(text: str) -> None:
        print(f"mixprec tune: {text}", flush=True)

    try:
        optimizer = None
        if args.workload:
            from mixprec.bench.devices import resolve_device
            from mixprec.bench.runner import make_optimizer

            device = resolve_device("auto")
            task = WORKLOADS[args.workload].build(args.size, device)
            model, (inputs, targets) = task.model.to(device), task.batch(0)
            optimizer = make_optimizer(task, model.parameters())

            def loss_fn(out: Any, targets: Any) -> torch.Tensor:
                return task.loss_fn(out.float(), targets)
        else:
            model, inputs, loss_fn, targets = common.user_task(args, "tune")  # type: ignore[assignment]
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
        recipe = tune(
            model,
            inputs,
            loss_fn,
            targets=targets,
            optimizer=optimizer,
            budget_s=args.budget,
            dtypes=dtypes,
            levels=levels,
            per_layer=args.per_layer,
            layer_sqnr_db=args.layer_sqnr_db,
            progress=say,
            memory_budget=args.memory_budget,
        )
    except (ValueError, TypeError) as exc:
        print(f"mixprec tune: {exc}", file=sys.stderr)
        return 2
    print(recipe.table())
    print(f"tuned in {recipe.tuning_s:.1f} s on {recipe.measured_on}")
    if args.out:
        recipe.to_json(args.out)
        print(f"wrote {args.out}")
    return 0
