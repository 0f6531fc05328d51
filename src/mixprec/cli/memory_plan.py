"""``mixprec memory-plan``: the bytes per rank a recipe will hold, before anything runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from mixprec.bench.workloads import WORKLOADS
from mixprec.cli import common

__all__ = ["run"]


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(model.parameters())


def run(args: argparse.Namespace) -> int:
    import mixprec

    try:
        if args.workload:
            task = WORKLOADS[args.workload].build(args.size, torch.device("cpu"))
            model, (inputs, targets) = task.model, task.batch(0)

            def loss_fn(out: Any) -> torch.Tensor:
                return task.loss_fn(out.float(), targets)
        else:
            model, inputs, user_loss, targets = common.user_task(args, "plan")
            loss_fn = None if user_loss is None else (lambda out: user_loss(out, targets))  # type: ignore[assignment]
        optimizer = _optimizer(args.optimizer, model)
        config = mixprec.PrepareConfig(
            level=args.level, optimizer_state=args.optimizer_state, step_in_backward=args.step_in_backward
        )
        plan = mixprec.memory_plan(model, optimizer, config, batch=inputs, loss_fn=loss_fn, world_size=args.world_size)
    except (ValueError, TypeError) as exc:
        print(f"mixprec memory-plan: {exc}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    if args.json:
        print(json.dumps({**plan.to_dict(), "parameter_count": params}))
        return 0
    print(plan)
    print(
        f"  {plan.state / params:.2f} bytes a parameter (weights, masters, gradients, optimizer state) over "
        f"{params / 1e6:.2f}M parameters"
    )
    return 0
