"""scaled_dot_product_attention forward and backward in fp32 and bf16 on this machine.

torch's CPU autocast lists SDPA among the ops run in low precision. On some CPUs its bf16
backward is slower than the fp32 one; this script measures both at the bench transformer's
attention shape, with a causal mask and with ``is_causal=True``, so the choice can be made on
numbers (``policy.add("fp32", F.scaled_dot_product_attention)`` runs it in fp32).

Run: python benchmarks/bench_attention.py [--batch 16] [--heads 16] [--seq 128] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


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


if __name__ == "__main__":
    main()
