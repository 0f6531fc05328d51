"""The quantized Adam step's time per million values, each way it can run, against torchao's and torch's.

One parameter of ``--numel`` values (bf16 weight and gradient, AdamW), the median of ``--repeat`` steps
after two warm-up steps, in ms per million values:

* **CPU kernel** (``optim/cpu_adam.py``, the default on the CPU): a block at a time;
* **compiled graph** (``optim/fused_adam.py``'s inductor graph, the default on other devices);
* **eager** (``optim/adam.py``, the reference);
* **torchao** ``AdamW8bit``/``AdamW4bit``/``AdamWFp8`` as shipped (compiled; ``--torchao``, slow to compile);
* **torch** ``AdamW`` on bf16 (foreach and fused), the step with no state to quantize.

    python benchmarks/bench_adam_step.py
    python benchmarks/bench_adam_step.py --torchao
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mixprec._src.optim import adam, fused_adam

GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
FORMATS = ("8bit", "4bit", "fp8")


def _time(step: Callable[[], Any], repeat: int, numel: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3 / (numel / 1e6)


def _ours(fmt: str, way: str, numel: int, repeat: int) -> float:
    p = torch.randn(numel).bfloat16()
    g = (torch.randn(numel) * 1e-3).bfloat16()
    state: dict[str, Any] = {}
    if way == "eager":
        return _time(lambda: adam.adam_step(p, g, state, GROUP, True, fmt), repeat, numel)
    assert fused_adam.available(), "inductor does not compile here"
    fused_adam.NATIVE = way == "CPU kernel"
    try:
        return _time(lambda: fused_adam.adam_step(p, g, state, GROUP, True, fmt), repeat, numel)
    finally:
        fused_adam.NATIVE = True


def _theirs(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], numel: int, repeat: int) -> float:
    p = torch.nn.Parameter(torch.randn(numel).bfloat16())
    p.grad = (torch.randn(numel) * 1e-3).bfloat16()
    optimizer = make([p])
    return _time(optimizer.step, repeat, numel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--torchao", action="store_true", help="time torchao's compiled optimizers too")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for way in ("CPU kernel", "compiled graph", "eager"):
        rows.append((f"mixprec, {way}", [_ours(fmt, way, args.numel, args.repeat) for fmt in FORMATS]))
    if args.torchao:
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's registration notice
        logging.getLogger("torchao").setLevel(logging.ERROR)  # and its CUDA extensions, absent on a CPU build
        from torchao import optim as ao

        makers = [lambda ps: ao.AdamW8bit(ps, lr=1e-3), lambda ps: ao.AdamW4bit(ps, lr=1e-3),
                  lambda ps: ao.AdamWFp8(ps, lr=1e-3)]  # fmt: skip
        rows.append(("torchao (compiled, as shipped)", [_theirs(make, args.numel, args.repeat) for make in makers]))
    foreach = _theirs(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), args.numel, args.repeat)
    fused = _theirs(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), args.numel, args.repeat)
    print(f"\nms a million values ({args.numel / 1e6:.1f}M-value bf16 parameter, AdamW, median of {args.repeat})\n")
    print("| step | 8-bit | 4-bit | fp8 |\n|---|---|---|---|")
    for name, values in rows:
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    print(f"| torch AdamW, bf16 state (foreach / fused) | {foreach:.2f} / {fused:.2f} | | |")


if __name__ == "__main__":
    main()
