"""Train the bench's transformer in bf16 and with fp8 linears (each recipe); compare final losses.

    python benchmarks/fp8_convergence.py --size quick --steps 300 --plot fp8_convergence.png

Every run starts from the same weights and sees the same batches; the model is prepared at O1
(bf16 autocast), with ``fp8=recipe`` for the fp8 runs (the MLP linears; attention's projections
are not ``nn.Linear`` calls and the output head is left out). The final loss is the mean of the
last 10% of steps; the table gives each fp8 recipe's relative difference from bf16's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch
from rich.progress import Progress

import mixprec
from mixprec.bench.runner import make_optimizer
from mixprec.bench.workloads import WORKLOADS

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")


def train(recipe: str | None, size: str, steps: int, on_step: Callable[[], None] = lambda: None) -> list[float]:
    """Losses of ``steps`` steps of the transformer at ``size`` (``recipe=None``: bf16 only)."""
    task = WORKLOADS["transformer"].build(size, torch.device("cpu"))
    optimizer = make_optimizer(task, task.model.parameters())
    model, optimizer = mixprec.prepare(task.model, optimizer, "O1", fp8=recipe)
    losses = []
    for step in range(steps):
        inputs, targets = task.batch(step)
        loss = task.loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        on_step()
    return losses


def final(losses: Sequence[float]) -> float:
    tail = max(1, len(losses) // 10)
    return sum(losses[-tail:]) / tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="quick", choices=("tiny", "quick", "default"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--plot", help="write the loss curves to this PNG")
    parser.add_argument("--json", help="write the losses to this JSON file")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    runs: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    with Progress() as progress:
        for name in ["bf16", *recipes]:
            bar = progress.add_task(name, total=args.steps)
            start = time.perf_counter()
            runs[name] = train(None if name == "bf16" else name, args.size, args.steps,
                               lambda bar=bar: progress.advance(bar))  # fmt: skip
            seconds[name] = time.perf_counter() - start
    base = final(runs["bf16"])
    print(f"transformer ({args.size}), {args.steps} steps; final loss = mean of the last {max(1, args.steps // 10)}")
    print(f"{'run':20} {'final loss':>10} {'vs bf16':>8} {'s':>6}")
    for name, losses in runs.items():
        diff = "" if name == "bf16" else f"{(final(losses) - base) / base:+.2%}"
        print(f"{name:20} {final(losses):10.4f} {diff:>8} {seconds[name]:6.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"size": args.size, "steps": args.steps, "losses": runs}, fh)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, losses in runs.items():
            ax.plot(losses, label=name, linewidth=1)
        ax.set(xlabel="step", ylabel="loss", title=f"transformer ({args.size}): bf16 and fp8 linears")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
