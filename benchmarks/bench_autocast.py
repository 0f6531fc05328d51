"""What mixprec.autocast costs over torch.autocast, per training step and per edited-op call.

1. Training steps (forward, backward, SGD step) of four models under torch.autocast, under
   mixprec.autocast with the built-in policy (a torch region: target >= 0.99x torch), and
   with a policy that moves one op (target >= 0.95x). The moved op is ``add`` into
   ``promote``: a hot op (residual and bias adds) whose result is the same as torch's, so
   the figure is the cost of mixprec's dispatcher kernel alone.
2. Per call, on tiny tensors where dispatch dominates: an op torch lists (``mm``) and an
   unlisted one (``add``), plain under torch.autocast and with mixprec's kernel.

Modes alternate step by step in rotating order (calls window by window) in one process, because
this machine is shared and noisy; a ratio is the median over rounds of the per-round ratio, a time
the median step (fastest window). Bitwise equality of the
losses is checked on the way. Run: python benchmarks/bench_autocast.py [--steps N] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

MOVED = mixprec.get_policy("cpu").add("promote", "add")


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 2000, dim: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(tokens))[0])


class TransformerLM(nn.Module):
    def __init__(self, vocab: int = 2000, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))


class ResidualCNN(nn.Module):
    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
            )
            for _ in range(3)
        )  # fmt: skip
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(images))
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(x.mean((2, 3)))


class EmbeddingSoftmax(nn.Module):
    """A bag-of-words classifier over a large vocabulary: embedding lookups and a wide softmax."""

    def __init__(self, vocab: int = 20000, dim: int = 256) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.hidden(self.embed(tokens))) + self.embed(tokens))


def _workloads() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    def tokens(batch: int, seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        return lambda: (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))

    return {
        "lstm": (LSTMLanguageModel, tokens(16, 64, 2000)),
        "transformer": (TransformerLM, tokens(16, 128, 2000)),
        "cnn": (ResidualCNN, lambda: (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))),
        "embedding-softmax": (
            EmbeddingSoftmax, lambda: (torch.randint(0, 20000, (64, 32)), torch.randint(0, 20000, (64,)))
        ),
    }  # fmt: skip


REGIONS: dict[str, Callable[[], Any]] = {
    "torch": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "mixprec": lambda: mixprec.autocast("cpu", dtype=torch.bfloat16),
    "mixprec+1 op": lambda: mixprec.autocast("cpu", dtype=torch.bfloat16, policy=MOVED),
}


@dataclasses.dataclass
class StepRow:
    workload: str
    ms: dict[str, float]  # median step time per mode
    ratios: dict[str, float]  # median over rounds of torch's step time / the mode's (>1: faster)
    same_losses: bool  # every mode's losses bitwise equal to torch's

    def ratio(self, mode: str) -> float:
        """Speed of ``mode`` relative to torch.autocast (steps/s ratio)."""
        return self.ratios[mode]


def bench_steps(name: str, steps: int, warmup: int = 3) -> StepRow:
    make, data = _workloads()[name]
    torch.manual_seed(0)
    models = {mode: make() for mode in REGIONS}
    for model in models.values():
        model.load_state_dict(models["torch"].state_dict())
    opts = {mode: torch.optim.SGD(m.parameters(), lr=1e-3) for mode, m in models.items()}
    times: dict[str, list[float]] = {mode: [] for mode in REGIONS}
    losses: dict[str, list[torch.Tensor]] = {mode: [] for mode in REGIONS}
    modes = list(REGIONS)
    for step in range(warmup + steps):
        torch.manual_seed(step)
        inputs, targets = data()
        # rotate the order, so each mode runs first, second and last equally often
        order = modes[step % len(modes) :] + modes[: step % len(modes)]
        for mode in order:
            model, opt = models[mode], opts[mode]
            start = time.perf_counter()
            with REGIONS[mode]():
                out = model(inputs)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= warmup:
                times[mode].append(time.perf_counter() - start)
            losses[mode].append(loss.detach())
    same = all(torch.equal(torch.stack(losses[m]), torch.stack(losses["torch"])) for m in REGIONS)
    # each step's ratio to torch's step in the same round, then the median: load that changes
    # between rounds falls on both sides of a ratio
    ratios = {m: statistics.median(a / b for a, b in zip(times["torch"], t, strict=True)) for m, t in times.items()}
    return StepRow(name, {m: 1e3 * statistics.median(t) for m, t in times.items()}, ratios, same)


def bench_calls(windows: int = 7, calls: int = 2000) -> dict[str, dict[str, float]]:
    a = torch.randn(8, 8)
    ops = {"mm (listed)": lambda: torch.mm(a, a), "add (unlisted)": lambda: torch.add(a, a)}
    edited = mixprec.get_policy("cpu").add("fp32", "mm").add("promote", "add")
    result: dict[str, dict[str, float]] = {}
    for op, fn in ops.items():
        best = {"torch": float("inf"), "mixprec kernel": float("inf")}
        for _ in range(windows):
            for mode, region in (
                ("torch", torch.autocast("cpu")),
                ("mixprec kernel", mixprec.autocast("cpu", policy=edited)),
            ):
                with region:
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    best[mode] = min(best[mode], (time.perf_counter() - start) / calls * 1e6)
        result[op] = best
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and workload")
    parser.add_argument("--workloads", default=",".join(_workloads()), help="comma-separated")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, {args.steps} steps per mode")
    rows = []
    print(f"{'workload':<18} {'torch ms':>9} {'mixprec ms':>11} {'ratio':>6} {'+1 op ms':>9} {'ratio':>6}  same losses")
    for name in args.workloads.split(","):
        row = bench_steps(name, args.steps)
        rows.append(row)
        print(
            f"{name:<18} {row.ms['torch']:>9.2f} {row.ms['mixprec']:>11.2f} {row.ratio('mixprec'):>6.3f} "
            f"{row.ms['mixprec+1 op']:>9.2f} {row.ratio('mixprec+1 op'):>6.3f}  {row.same_losses}"
        )
    calls = bench_calls()
    print(f"\n{'per call (8x8)':<18} {'torch us':>9} {'mixprec kernel us':>18}")
    for op, best in calls.items():
        print(f"{op:<18} {best['torch']:>9.2f} {best['mixprec kernel']:>18.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": [dataclasses.asdict(r) for r in rows], "calls": calls}, f, indent=2)


if __name__ == "__main__":
    main()
