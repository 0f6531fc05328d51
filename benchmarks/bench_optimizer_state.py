"""Optimizer state precision: bytes per parameter, the optimizer step's time and the final loss, per recipe.

For the bench's MLP and transformer (``--size``), each recipe (a prepare level with
``optimizer_state`` fp32, 8bit, 4bit or fp8) trains ``--steps`` steps from the same weights and data with
AdamW; it reports ``mixprec.memory_report``'s bytes per parameter (weights, masters, gradients,
optimizer state; activations aside), the median time of ``optimizer.step()`` against torch's fused
AdamW on the same parameters at that level (a ratio from one run), and the final loss (mean of the
last fifth of the steps) against plain fp32 AdamW's.

    python benchmarks/bench_optimizer_state.py                  # a Markdown table on stdout
    python benchmarks/bench_optimizer_state.py --size quick --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch

import mixprec
from mixprec.bench.workloads import WORKLOADS

RECIPES = [("fp32", None, "fp32")] + [(level, level, state) for level in ("O1", "O2", "bf16-sr", "bf16-pure")
                                     for state in ("fp32", "8bit", "4bit", "fp8")]  # fmt: skip


def run(workload: str, size: str, level: str | None, state: str, steps: int, fused: bool = False) -> dict[str, Any]:
    task = WORKLOADS[workload].build(size, torch.device("cpu"))
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr, fused=fused or None)
    if level is not None:
        mixprec.prepare(model, optimizer, level, optimizer_state=state)
    losses, step_times = [], []
    for step in range(steps):
        x, y = task.batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=level is not None):
            loss = task.loss_fn(model(x).float(), y)
        loss.backward()
        begin = time.perf_counter()
        optimizer.step()
        step_times.append(time.perf_counter() - begin)
        losses.append(loss.item())
    report = mixprec.memory_report(model, optimizer)
    params = sum(p.numel() for p in model.parameters())
    tail = losses[-max(1, steps // 5) :]
    return {"bytes": report.total / params, "state": report.optimizer_state / params,
            "step_s": statistics.median(step_times[1:] or step_times), "loss": sum(tail) / len(tail)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "quick", "default"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workloads", default="mlp,transformer")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print("| workload | recipe | bytes/param | of which state | step vs fused AdamW | final loss | vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        reference = run(workload, args.size, None, "fp32", args.steps)
        for name, level, state in RECIPES:
            got = reference if level is None else run(workload, args.size, level, state, args.steps)
            fused = run(workload, args.size, level, "fp32", 12, fused=level not in ("bf16-pure", "bf16-sr"))["step_s"]
            print(f"| {workload} | {name if level is None else f'{level} state={state}'} | {got['bytes']:.2f} | "
                  f"{got['state']:.2f} | {got['step_s'] / fused:.2f}x | {got['loss']:.4f} | "
                  f"{(got['loss'] - reference['loss']) / reference['loss']:+.2%} |")  # fmt: skip


if __name__ == "__main__":
    main()
