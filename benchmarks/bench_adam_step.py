"""The quantized (and bf16) Adam step's time per million values, each way it can run, against torchao's and torch's.

One parameter of ``--numel`` values (bf16 weight and gradient, AdamW), the median of ``--repeat`` steps
after two warm-up steps, in ms per million values:

* **CPU kernel** (``optim/cpu_adam.py``, the default on the CPU): a block at a time;
* **compiled graph** (``optim/fused_adam.py``'s inductor graph, the default on other devices; not for bf16 state);
* **eager** (``optim/adam.py``, the reference; bf16 state: ``step/bf16_state.py``'s chunks of fp32 copies, its
  default off the CPU);
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

from mixprec._src.optim import adam, cpu_adam, fused_adam
from mixprec._src.step import bf16_state

GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
FORMATS = ("8bit", "4bit", "fp8", "bf16")


def _time(step: Callable[[], Any], repeat: int, numel: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3 / (numel / 1e6)


def _bf16(way: str, p: torch.Tensor, g: torch.Tensor, numel: int, repeat: int) -> float:
    """bf16 state (the weight written to nearest, as at bf16-pure): the CPU kernel, or the chunks."""
    if way == "compiled graph":
        return float("nan")
    state: dict[str, Any] = {}
    builds = cpu_adam.bf16_builds
    if way == "eager":
        cpu_adam.bf16_builds = lambda *_: False  # type: ignore[assignment]

    def step() -> None:
        nearest = (None, None, None)  # the weight written to nearest
        bf16_state.adam_step(p, p, g, state, GROUP, True, lambda name, count: count, lambda at, part: nearest)

    try:
        return _time(step, repeat, numel)
    finally:
        cpu_adam.bf16_builds = builds  # type: ignore[assignment]


def _ours(fmt: str, way: str, numel: int, repeat: int) -> float:
    p = torch.randn(numel).bfloat16()
    g = (torch.randn(numel) * 1e-3).bfloat16()
    state: dict[str, Any] = {}
    if fmt == "bf16":
        return _bf16(way, p, g, numel, repeat)
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
        theirs = [_theirs(make, args.numel, args.repeat) for make in makers]
        rows.append(("torchao (compiled, as shipped)", [*theirs, float("nan")]))  # torchao keeps no bf16 state
    foreach = _theirs(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), args.numel, args.repeat)
    fused = _theirs(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), args.numel, args.repeat)
    print(f"\nms a million values ({args.numel / 1e6:.1f}M-value bf16 parameter, AdamW, median of {args.repeat})\n")
    print("| step | 8-bit | 4-bit | fp8 | bf16 (stochastic) |\n|---|---|---|---|---|")
    for name, values in rows:
        print(f"| {name} | " + " | ".join("" if v != v else f"{v:.2f}" for v in values) + " |")
    print(f"| torch AdamW, bf16 state (foreach / fused) | {foreach:.2f} / {fused:.2f} | | | |")


if __name__ == "__main__":
    main()
