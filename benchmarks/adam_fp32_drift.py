"""How far the CPU kernel's fp32 weights are from the eager quantized-state Adam step's (torchao's algorithm).

The kernel (``optim/cpu_adam.py``) and the eager step (``optim/adam.py``) make the same moments bit for bit; fp32
weights differ where torch's CPU ``sqrt`` (MKL's) is not correctly rounded on this machine. The difference is about
a unit in the last place of the *update*; a weight near zero, about the size of its update, then differs by many
of its own units in the last place, and two runs drift apart. For each state precision, from the same state (three
eager steps of a 300x257 weight, lr 1e-2, AdamW) and the same gradients, both steps ``--steps`` times:

* the share of weights that differ, and the largest difference in units of the weight's last place, at what
  ``|w|``;
* the largest difference in units of the last place of ``max(|w|, lr)`` (the larger of the weight and its
  update's scale).

    python benchmarks/adam_fp32_drift.py --steps 5
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from mixprec._src.optim import adam, cpu_adam, fused_adam

GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _start(precision: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    p, state = torch.randn(shape, generator=g), {}
    for step in range(3):
        grad = torch.randn(shape, generator=g) * 10.0 ** -(step % 3)
        adam.adam_step(p, grad, state, GROUP, True, precision, 0)
    return p, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    shape = (300, 257)
    print("| state | step | weights differing | most ulps of the weight | at abs(w) | most ulps of max(w, lr) |")
    print("|---|---|---|---|---|---|")
    for precision in ("8bit", "4bit", "fp8"):
        if not cpu_adam.available(precision, torch.zeros(2), torch.zeros(2)):
            print(f"no C++ toolchain for {precision}")
            continue
        p, state = _start(precision, shape)
        eager_p, eager_state = p.clone(), copy.deepcopy(state)
        for step in range(args.steps):
            grad = torch.randn(shape, generator=torch.Generator().manual_seed(9 + step)) * 1e-2
            adam.adam_step(eager_p, grad, eager_state, GROUP, True, precision, 0)
            fused_adam._step(None, p, grad, state, GROUP, True, precision, 0, native=True,
                             rounding=None, seed_at=None, comp=None)  # fmt: skip
            ulp = torch.nextafter(eager_p.abs(), torch.tensor(float("inf"))) - eager_p.abs()
            ulps = (p - eager_p).abs() / ulp
            worst = int(ulps.argmax())
            larger = eager_p.abs().clamp(min=GROUP["lr"])
            scaled = (p - eager_p).abs() / (torch.nextafter(larger, torch.tensor(float("inf"))) - larger)
            if step in (0, args.steps - 1):
                differing = float((p != eager_p).float().mean())
                print(f"| {precision} | {step + 1} | {differing:.2%} | {float(ulps.max()):.0f} "
                      f"| {float(eager_p.flatten()[worst].abs()):.1e} | {float(scaled.max()):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
