"""bf16-sr's and bf16-kahan's Adam(W) step on the CPU: the list kernel against the compiled per-tensor kernel and torch.

One bf16 weight of ``--numel`` values (gradient and moments bf16), AdamW; the median of ``--repeat`` steps after two
warm-up steps, in ms:

* **list** (``optim/cpu_lists.py``, the default on the CPU): the group's weights in one C++ call (here one weight);
  bf16-sr's stochastic rounding and bf16-kahan's compensated write;
* **compiled** (``step/sr_kernel.py``'s inductor kernel, a weight at a time: the default off the CPU);
* **torch** ``AdamW(fused=True)`` on the bf16 weight (moments rounded to nearest).

    python benchmarks/bench_list_step.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mixprec._src.optim import cpu_lists
from mixprec._src.step.sr_kernel import adam_scalars, compiled_kernel


def _median_ms(step: Callable[[], object], repeat: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    p, grad, m = (torch.randn(args.numel, generator=g).bfloat16() * 0.01 for _ in range(3))
    v, comp = (torch.rand(args.numel, generator=g) * 1e-4).bfloat16(), torch.zeros(args.numel, dtype=torch.bfloat16)
    scalars = adam_scalars({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}, 3.0, True)
    kernel, seed = compiled_kernel(), torch.tensor(5, dtype=torch.int32)
    weight = torch.nn.Parameter(p.clone())
    weight.grad = grad.clone()
    fused = torch.optim.AdamW([weight], fused=True)
    rows = {
        "list, bf16-sr": lambda: cpu_lists.adam_step([(p, grad, m, v, None, 123)], scalars, cpu_lists.STOCHASTIC),
        "list, bf16-kahan": lambda: cpu_lists.adam_step([(p, grad, m, v, comp, 0)], scalars, cpu_lists.KAHAN),
        "compiled per tensor, bf16-sr": None if kernel is None else lambda: kernel(p, grad, m, v, seed, scalars),
        "torch AdamW(fused=True), bf16": fused.step,
    }
    print(f"torch {torch.__version__}, {args.numel} values, {torch.get_num_threads()} threads; median ms a step")
    with torch.no_grad():
        for name, step in rows.items():
            print(f"{name:32} {'not built' if step is None else f'{_median_ms(step, args.repeat):.2f}'}")


if __name__ == "__main__":
    main()
