"""A planted outlier layer in fp16 training: the run without the guard, with it, and fp32.

From step ``--outlier-at`` on, the batches carry an unnormalized feature (1e5): layer ``0``'s fp16
output overflows at every step. Without the guard GradScaler skips every step from there and its
scale collapses (the loss stops moving); with ``mixprec.Guard`` the layer moves to bf16 after two
steps and training goes on beside fp32's. ``tests/layers/test_guard.py`` runs this scenario.

    python benchmarks/guard_outlier.py [--steps 200] [--plot docs/images/guard_outlier.png]
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import time
from typing import Any

import torch
from torch import nn

import mixprec

OUTLIER_AT, STEPS = 100, 200


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.GELU(), nn.Linear(64, 8))  # fmt: skip


def batch(step: int, outlier_at: int = OUTLIER_AT) -> tuple[torch.Tensor, torch.Tensor]:
    """16 fixed batches of a smooth regression; from ``outlier_at`` on, the inputs come 3e4 times larger."""
    g = torch.Generator().manual_seed(step % 16)
    x = torch.randn(64, 32, generator=g)
    y = torch.sin(1.5 * x[:, :8]) + 0.5 * x[:, 8:16]
    if step >= outlier_at:  # the inputs' units change: the LayerNorm after layer 0 absorbs it, fp16 cannot
        x = x * 3e4
    return x, y


class Run:
    """A model, AdamW and a GradScaler trained on :func:`batch` in fp32 or fp16 autocast, optionally guarded."""

    def __init__(self, dtype: torch.dtype, guarded: bool, outlier_at: int = OUTLIER_AT, steps: int = STEPS,
                 **guard_args: Any) -> None:  # fmt: skip
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        # a cosine schedule to zero: every run ends settled, so final losses compare to a fraction of a percent
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, steps)
        self.fp16 = dtype is torch.float16
        self.outlier_at = outlier_at
        self.scaler = mixprec.GradScaler("cpu", enabled=self.fp16, fail_after=None)
        self.guard = mixprec.Guard(self.model, self.scaler, **guard_args) if guarded else None
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.skipped = 0

    def train(self, begin: int, end: int) -> Run:
        for step in range(begin, end):
            x, y = batch(step, self.outlier_at)
            self.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=self.fp16):
                loss = (self.model(x).float() - y).square().mean()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.skipped += self.scaler.skipped(self.optimizer) if self.fp16 else 0
            self.scaler.update()
            self.schedule.step()
            if self.guard is not None:
                self.guard.step()
            self.losses.append(loss.item())
            self.scales.append(self.scaler.get_scale() if self.fp16 else 1.0)
        return self

    def final(self) -> float:
        """The mean loss of the last 16 steps (one pass over the 16 batches)."""
        return sum(self.losses[-16:]) / 16

    def state(self) -> dict[str, Any]:
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                              "scaler": self.scaler.state_dict(), "schedule": self.schedule.state_dict(),
                              "guard": self.guard.state_dict() if self.guard else None})  # fmt: skip


def _plot(runs: dict[str, Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, scale_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, run), color in zip(runs.items(), ("tab:blue", "tab:red", "tab:green"), strict=False):
        finite = "" if all(math.isfinite(v) for v in run.losses) else " (NaN from the outlier on)"
        loss_ax.plot(run.losses, label=name + finite, color=color)
        if run.fp16:
            scale_ax.plot(run.scales, label=name, color=color)
    for ax in (loss_ax, scale_ax):
        ax.axvline(runs["fp32"].outlier_at, color="grey", linestyle=":", label="outlier appears")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.legend()
    loss_ax.set_title("loss")
    scale_ax.set_title("loss scale (GradScaler)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--outlier-at", type=int, default=OUTLIER_AT)
    parser.add_argument("--plot", help="write the loss and loss-scale curves to this PNG")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    begin = time.perf_counter()
    runs = {
        "fp32": Run(torch.float32, False, args.outlier_at).train(0, args.steps),
        "fp16": Run(torch.float16, False, args.outlier_at).train(0, args.steps),
        "fp16 + Guard": Run(torch.float16, True, args.outlier_at).train(0, args.steps),
    }
    reference = runs["fp32"].final()
    print(f"{'run':<14} {'final loss':>10} {'vs fp32':>9} {'skipped':>8} {'final scale':>12}")
    for name, run in runs.items():
        print(f"{name:<14} {run.final():>10.4f} {(run.final() - reference) / reference:>+9.2%} {run.skipped:>8} "
              f"{run.scales[-1]:>12.3g}")  # fmt: skip
    guard = runs["fp16 + Guard"].guard
    assert guard is not None
    for move in guard.moves:
        print(f"guard: {move}")
    print(f"{time.perf_counter() - begin:.1f} s")
    if args.plot:
        _plot(runs, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
