"""A short real training run: fp32, torch.autocast and mixprec.autocast side by side.

Trains a wide MLP regressor and a small causal transformer for a fixed number of
steps in each mode (same seed, same data) and prints steps/s, speed-up over fp32,
the mixprec/torch.autocast throughput ratio and the final loss. Defaults take about
a minute on a 2-core CPU. Run: python examples/demo.py [--steps N] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


class TinyLM(nn.Module):
    """A small pre-norm causal transformer language model."""

    def __init__(self, vocab: int = 256, dim: int = 256, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.embed(tokens), mask=mask, is_causal=True)))


def _mlp_task(device: str) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable[..., Any]]:
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1))
    teacher = torch.randn(256, 1, generator=torch.Generator().manual_seed(7)) / 16

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(512, 256, generator=torch.Generator().manual_seed(step))
        return x.to(device), torch.sin(x @ teacher).to(device)

    return model, batch, F.mse_loss


def _lm_task(device: str) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable[..., Any]]:
    # A repeating pattern with noise: learnable, so the loss falls visibly in a few steps.
    base = torch.arange(64) * 37 % 256

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        shift = torch.randint(0, 64, (16, 1), generator=g)
        tokens = base[(torch.arange(65) + shift) % 64]
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return TinyLM(), batch, loss_fn


TASKS = {"mlp": _mlp_task, "transformer": _lm_task}


def run(task: str, mode: str, steps: int, device: str, dtype: torch.dtype) -> dict[str, float]:
    torch.manual_seed(0)
    model, batch, loss_fn = TASKS[task](device)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    region: Callable[[], Any] = {
        "fp32": contextlib.nullcontext,
        "torch.autocast": lambda: torch.autocast(device, dtype=dtype),
        "mixprec": lambda: mixprec.autocast(device, dtype=dtype),
    }[mode]
    times, loss = [], float("nan")
    for step in range(steps):
        x, y = batch(step)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with region():
            out = loss_fn(model(x), y)
        out.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        loss = out.item()
        if not torch.isfinite(out):
            raise RuntimeError(f"{task}/{mode}: loss became {loss} at step {step}")
    warm = times[min(3, steps - 1) :]
    return {"steps_per_s": 1.0 / statistics.median(warm), "final_loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"mixprec {mixprec.__version__}, torch {torch.__version__}, device {args.device}, dtype {args.dtype}")
    print(f"{args.steps} steps per run; steps/s is the median after 3 warm-up steps\n")
    header = f"{'workload':12} {'mode':15} {'steps/s':>8} {'vs fp32':>8} {'vs torch':>9} {'final loss':>11}"
    print(header)
    print("-" * len(header))
    for task in TASKS:
        results: dict[str, dict[str, float]] = {}
        for mode in ("fp32", "torch.autocast", "mixprec"):
            results[mode] = r = run(task, mode, args.steps, args.device, dtype)
            speedup = r["steps_per_s"] / results["fp32"]["steps_per_s"]
            ratio = r["steps_per_s"] / results["torch.autocast"]["steps_per_s"] if mode == "mixprec" else None
            ratio_text = f"{ratio:9.3f}" if ratio is not None else f"{'':9}"
            print(f"{task:12} {mode:15} {r['steps_per_s']:8.2f} {speedup:7.2f}x {ratio_text} {r['final_loss']:11.4f}")
            sys.stdout.flush()
        same = results["mixprec"]["final_loss"] == results["torch.autocast"]["final_loss"]
        print(f"{'':12} mixprec final loss {'equals' if same else 'DIFFERS FROM'} torch.autocast's bit for bit\n")


if __name__ == "__main__":
    main()
