"""scaled_dot_product_attention forward and backward in fp32 and bf16 on this machine.

torch's CPU autocast lists SDPA among the ops run in low precision. On some CPUs its bf16
backward is slower than the fp32 one; this script measures both at the bench transformer's
attention shape, with a causal mask and with ``is_causal=True``, so the choice can be made on
numbers (``policy.add("fp32", F.scaled_dot_product_attention)`` runs it in fp32). It then trains
the bench transformer (default size, fused AdamW) under mixprec.autocast with the built-in "cpu"
policy and with that policy, alternating steps, and reports the median step times.

Run: python benchmarks/bench_attention.py [--batch 16] [--heads 16] [--seq 128] [--head-dim 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.bench.runner import _allocator_tracks_live_memory
from mixprec.bench.workloads import WORKLOADS


def _fastest(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per policy (0: skip)")
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    mask = nn.Transformer.generate_square_subsequent_mask(args.seq)
    print(f"torch {torch.__version__}, q/k/v {tuple(shape)}, fastest of {args.repeats} (ms)")
    results: dict[tuple[str, torch.dtype], float] = {}
    for variant in ("mask", "is_causal"):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
            attn_mask = mask.to(dtype) if variant == "mask" else None
            causal = variant == "is_causal"

            def forward(q=q, k=k, v=v, m=attn_mask, c=causal) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c)

            out = forward()
            grad = torch.ones_like(out)
            fwd = _fastest(forward, args.repeats)
            bwd = _fastest(lambda out=out, grad=grad: out.backward(grad, retain_graph=True), args.repeats)
            results[(variant, dtype)] = fwd + bwd
            print(f"  {variant:9s} {dtype!s:15s} forward {fwd:7.1f}  backward {bwd:7.1f}  total {fwd + bwd:7.1f}")
        ratio = results[(variant, torch.bfloat16)] / results[(variant, torch.float32)]
        print(f"  {variant}: bf16 forward+backward takes {ratio:.2f}x the fp32 time")
    if args.steps:
        _training_steps(args.steps)


def _training_steps(steps: int) -> None:
    _allocator_tracks_live_memory(False)  # reuse freed buffers, as a long run does
    policies = {
        "cpu (torch's lists)": mixprec.get_policy("cpu"),
        "cpu + SDPA in fp32": mixprec.get_policy("cpu").add("fp32", F.scaled_dot_product_attention),
    }
    runs = {}
    for name in policies:
        task = WORKLOADS["transformer"].build("default", torch.device("cpu"))
        runs[name] = (task, torch.optim.AdamW(task.model.parameters(), lr=task.lr, fused=True), [], [])
    names = list(policies)
    for step in range(steps + 2):
        for name in names if step % 2 == 0 else reversed(names):
            task, optimizer, times, losses = runs[name]
            inputs, targets = task.batch(step)
            start = time.perf_counter()
            optimizer.zero_grad()
            with mixprec.autocast("cpu", policy=policies[name]):
                loss = task.loss_fn(task.model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if step >= 2:
                times.append((time.perf_counter() - start) * 1e3)
            losses.append(loss.item())
    print(f"bench transformer (default size), median of {steps} training steps under mixprec.autocast:")
    for name, (_, _, times, losses) in runs.items():
        median = statistics.median(times)
        print(f"  {name:20s} {median:7.1f} ms per step, loss after {steps + 2} steps {losses[-1]:.4f}")
    base, alt = (statistics.median(runs[n][2]) for n in names)
    print(f"  SDPA in fp32: the step is {base / alt:.2f}x as fast")


if __name__ == "__main__":
    main()
