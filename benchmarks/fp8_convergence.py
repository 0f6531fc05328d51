"""Train the bench's transformer LM in bf16 and with fp8 linears (each recipe); compare final losses.

    python benchmarks/fp8_convergence.py --dim 128 --steps 400 --plot fp8_convergence.png

The bench's ``TinyLM`` (pre-norm transformer, 2 layers) on its Markov-source text, at a width
between the bench's sizes so that it learns within a few hundred steps on a CPU. Every run starts
from the same weights and sees the same batches; the model is prepared at O1 (bf16 autocast),
with ``fp8=recipe`` for the fp8 runs (the MLP linears; attention's projections are not
``nn.Linear`` calls and the output head is left out). The final loss is the mean of the last 10%
of steps; the table gives each fp8 recipe's relative difference from bf16's.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from rich.progress import Progress

import mixprec
from mixprec.bench.runner import make_optimizer
from mixprec.bench.workloads import WORKLOADS, TinyLM, markov_text

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")


SEQ, BATCH, VOCAB = 64, 16, 256


Batch = tuple[torch.Tensor, torch.Tensor]


def _losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer, recipe: str | None,
            batch: Callable[[int], Batch], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            steps: int, on_step: Callable[[], None]) -> list[float]:  # fmt: skip
    """Prepare at O1 (with ``fp8=recipe``) and train ``steps`` steps; the loss of each."""
    model, optimizer = mixprec.prepare(model, optimizer, "O1", fp8=recipe)
    losses = []
    for step in range(steps):
        inputs, targets = batch(step)
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        on_step()
    return losses


def train(recipe: str | None, dim: int, steps: int, on_step: Callable[[], None] = lambda: None) -> list[float]:
    """Losses of ``steps`` steps of a ``dim``-wide TinyLM (``recipe=None``: bf16 only)."""
    torch.manual_seed(0)
    model = TinyLM(VOCAB, dim, layers=2, heads=max(1, dim // 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = markov_text(100_000, VOCAB)

    def batch(step: int) -> Batch:
        starts = torch.randint(0, len(text) - SEQ - 1, (BATCH,), generator=torch.Generator().manual_seed(step))
        window = torch.stack([text[s : s + SEQ + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return _losses(model, optimizer, recipe, batch, loss_fn, steps, on_step)


def train_workload(recipe: str | None, workload: str, size: str, steps: int,
                   on_step: Callable[[], None] = lambda: None) -> list[float]:  # fmt: skip
    """Losses of ``steps`` steps of a bench workload at ``size`` (``recipe=None``: bf16 only)."""
    task = WORKLOADS[workload].build(size, torch.device("cpu"))
    optimizer = make_optimizer(task, task.model.parameters())
    return _losses(task.model, optimizer, recipe, task.batch, task.loss_fn, steps, on_step)


def final(losses: Sequence[float]) -> float:
    tail = max(1, len(losses) // 10)
    return sum(losses[-tail:]) / tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="transformer", choices=("transformer", "mlp"))
    parser.add_argument("--dim", type=int, default=128, help="the transformer's width (a multiple of 16)")
    parser.add_argument("--size", default="tiny", help="the mlp workload's bench size")
    parser.add_argument("--steps", type=int, default=400)
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
            recipe = None if name == "bf16" else name
            advance = functools.partial(progress.advance, bar)
            if args.workload == "transformer":
                runs[name] = train(recipe, args.dim, args.steps, advance)
            else:
                runs[name] = train_workload(recipe, args.workload, args.size, args.steps, advance)
            seconds[name] = time.perf_counter() - start
    base = final(runs["bf16"])
    what = (
        f"TinyLM dim {args.dim}, 2 layers, {BATCH}x{SEQ} tokens a step"
        if args.workload == "transformer"
        else (f"{args.workload} ({args.size})")
    )
    print(f"{what}, {args.steps} steps; final loss = mean of the last {max(1, args.steps // 10)} steps")
    print(f"{'run':20} {'final loss':>10} {'vs bf16':>8} {'s':>6}")
    for name, losses in runs.items():
        diff = "" if name == "bf16" else f"{(final(losses) - base) / base:+.2%}"
        print(f"{name:20} {final(losses):10.4f} {diff:>8} {seconds[name]:6.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"dim": args.dim, "steps": args.steps, "losses": runs}, fh)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, losses in runs.items():
            ax.plot(losses, label=name, linewidth=1)
        ax.set(xlabel="step", ylabel="loss", title=f"{what}: bf16 and fp8 linears")
        ax.set_yscale("log" if args.workload != "transformer" else "linear")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
