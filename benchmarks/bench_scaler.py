"""Per-iteration cost of mixprec.GradScaler against torch.amp.GradScaler.

A model with many small parameter tensors (default 400) makes the scaler's own work
(grouping gradients, the fused unscale-and-check, the inf/NaN read, the update) visible.
Each iteration runs backward outside the timed part; the timed part is
scale(loss) + step(optimizer) + update(), with plain SGD. The two scalers alternate
iteration by iteration; figures are medians. Target: mixprec no slower (ratio <= 1.0).

Run: python benchmarks/bench_scaler.py [--layers 200] [--iterations 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import mixprec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=200, help="Linear layers (two parameter tensors each)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=False,
                        help="use fused Adam (no host sync in step) instead of SGD")  # fmt: skip
    args = parser.parse_args()

    scalers = {"torch": torch.amp.GradScaler("cpu"), "mixprec": mixprec.GradScaler("cpu")}
    models, optimizers = {}, {}
    for name in scalers:
        torch.manual_seed(0)
        models[name] = nn.Sequential(*[nn.Linear(8, 8) for _ in range(args.layers)])
        params = models[name].parameters()
        optimizers[name] = torch.optim.Adam(params, fused=True) if args.fused else torch.optim.SGD(params, lr=1e-3)
    x = torch.randn(4, 8)
    times: dict[str, list[float]] = {name: [] for name in scalers}

    def iteration(name: str) -> float:
        model, opt, scaler = models[name], optimizers[name], scalers[name]
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        start = time.perf_counter()
        scaled = scaler.scale(loss)
        elapsed = time.perf_counter() - start
        scaled.backward()
        start = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        return elapsed + time.perf_counter() - start

    for name in scalers:  # warm-up
        for _ in range(5):
            iteration(name)
    for i in range(args.iterations):
        for name in scalers if i % 2 else reversed(list(scalers)):
            times[name].append(iteration(name))

    n_params = sum(1 for _ in models["torch"].parameters())
    print(f"torch {torch.__version__}; {n_params} parameter tensors; "
          f"{'fused Adam' if args.fused else 'SGD'}; {args.iterations} alternating iterations")  # fmt: skip
    for name, values in times.items():
        print(f"{name:8} scale+step+update: median {statistics.median(values) * 1e6:8.1f} us")
    ratio = statistics.median(times["mixprec"]) / statistics.median(times["torch"])
    print(f"mixprec / torch time: {ratio:.3f} (target <= 1.0)")
    same = all(
        torch.equal(a, b) for a, b in zip(models["torch"].parameters(), models["mixprec"].parameters(), strict=True)
    )
    print(f"parameters bitwise equal after the run: {same}")


if __name__ == "__main__":
    main()
