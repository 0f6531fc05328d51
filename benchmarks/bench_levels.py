"""Where a training step's time goes at each precision level: forward, backward, optimizer.

Builds each bench workload once per mode (the bench's own models, data and fused optimizers),
steps all modes in lockstep with alternating order, and times the three phases of every step
separately. Reports median milliseconds per phase and each mode's total against O1 (the
``mixprec`` mode). It shows what a level can save: O2 and the bf16 levels only remove weight
casts, gradient casts and fp32 optimizer traffic, so their gain is bounded by the share of
those in O1's step.

Run: python benchmarks/bench_levels.py [--size default] [--steps 12] [--workloads mlp,transformer]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.progress import track

from mixprec.bench.modes import MODES
from mixprec.bench.runner import BenchConfig, _allocator_tracks_live_memory, _Run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="default", choices=["tiny", "quick", "default"])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (after 2 warm-up steps)")
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--modes", default="mixprec,O2,bf16-pure,bf16-sr")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "mixprec" not in modes:
        parser.error("--modes must include mixprec (O1), the reference")
    _allocator_tracks_live_memory(False)  # reuse freed buffers, as a long run does
    device, dtype = torch.device("cpu"), torch.bfloat16
    print(f"torch {torch.__version__}, size {args.size}, bf16 on cpu, {args.steps} timed steps per mode")
    for workload in args.workloads.split(","):
        config = BenchConfig(workloads=(workload,), modes=tuple(modes), size=args.size)
        runs = {mode: _Run(workload, MODES[mode], config, device, dtype) for mode in modes}
        phases: dict[str, list[list[float]]] = {mode: [[], [], []] for mode in modes}
        for step in track(range(args.steps + 2), description=workload, transient=True):
            for mode in modes if step % 2 == 0 else reversed(modes):
                run = runs[mode]
                inputs, targets = run.task.batch(step)
                start = time.perf_counter()
                run.optimizer.zero_grad(set_to_none=True)
                with run.mode.context(device.type, dtype):
                    loss = run.task.loss_fn(run.model(inputs), targets)
                forward = time.perf_counter()
                loss.backward()  # type: ignore[no-untyped-call]
                backward = time.perf_counter()
                run.optimizer.step()
                end = time.perf_counter()
                if step >= 2:
                    for i, seconds in enumerate((forward - start, backward - forward, end - backward)):
                        phases[mode][i].append(seconds * 1e3)
        medians = {mode: [statistics.median(p) for p in phases[mode]] for mode in modes}
        o1_total = sum(medians["mixprec"])
        print(f"\n{workload}: median ms per phase")
        print(f"  {'mode':10s} {'forward':>8s} {'backward':>9s} {'optimizer':>10s} {'total':>8s} {'vs O1':>7s}")
        for mode in modes:
            fwd, bwd, opt = medians[mode]
            total = fwd + bwd + opt
            print(f"  {mode:10s} {fwd:8.1f} {bwd:9.1f} {opt:10.1f} {total:8.1f} {o1_total / total:6.3f}x")
        fwd, bwd, opt = medians["mixprec"]
        print(f"  O1's optimizer step is {opt / o1_total:.1%} of its step")


if __name__ == "__main__":
    main()
