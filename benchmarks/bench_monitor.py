"""Cost of mixprec.Monitor on healthy training steps.

Trains each bench workload twice from the same seed, one copy watched by a Monitor (with a
GradScaler listening for skips) and one not, alternating single steps so both see the same
machine load; reports the median step times and their ratio. Target: under 3% overhead.

Run: python benchmarks/bench_monitor.py [--size quick] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mixprec
from mixprec.bench.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="quick", choices=["tiny", "quick", "default"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workloads", default="mlp,transformer,cnn")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, size {args.size}, {args.steps} alternating steps, bf16 autocast")
    for name in args.workloads.split(","):
        runs = {}
        for watched in (False, True):
            task = WORKLOADS[name].build(args.size, torch.device("cpu"))
            opt = torch.optim.AdamW(task.model.parameters(), lr=task.lr)
            scaler = mixprec.GradScaler("cpu", enabled=False)
            monitor = mixprec.Monitor(task.model, scaler) if watched else None
            runs[watched] = (task, opt, monitor, [])

        def step(watched: bool, i: int, runs: dict[bool, tuple] = runs) -> None:  # type: ignore[type-arg]
            task, opt, _, times = runs[watched]
            x, y = task.batch(i)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with mixprec.autocast("cpu"):
                loss = task.loss_fn(task.model(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)

        for i in range(args.steps + 2):
            for watched in (False, True) if i % 2 else (True, False):
                step(watched, i)
        plain = statistics.median(runs[False][3][2:])
        watched_t = statistics.median(runs[True][3][2:])
        print(f"{name:12} plain {plain * 1e3:8.2f} ms  monitored {watched_t * 1e3:8.2f} ms  "
              f"overhead {100 * (watched_t / plain - 1):+.2f}%")  # fmt: skip
        for _, _, monitor, _ in runs.values():
            if monitor is not None:
                monitor.close()


if __name__ == "__main__":
    main()
