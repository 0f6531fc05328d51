"""Training state per rank at every prepare level under FSDP2, on the bench's transformer, at 1, 2 and 4 ranks.

Each world size is one spawned gloo group (1: one process, unsharded). Every rank builds the
bench's transformer (``--size``, default: the bench's default), shards each block and then the
model with ``fully_shard``, builds AdamW, calls ``mixprec.prepare`` and trains real steps; the
training state it then holds is what ``mixprec.memory_report`` counts (weights, masters,
gradients, optimizer state), exact bytes. The batch is small (``--batch``, ``--seq``): the
state does not depend on it, and bf16 matmuls are slow on CPUs without bf16 instructions.

    python benchmarks/bench_memory.py                    # writes a Markdown table to stdout
    python benchmarks/bench_memory.py --ranks 1,2 --size quick
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import mixprec
from mixprec.bench.workloads import WORKLOADS

LEVELS = ("O1", "O2", "bf16-sr", "bf16-pure")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, results: Any, args: argparse.Namespace) -> None:
    import warnings

    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", module="torch.distributed")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for level in LEVELS:
        task = WORKLOADS["transformer"].build(args.size, torch.device("cpu"))
        model = task.model
        if world > 1:
            for block in model.blocks.layers:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=task.lr)
        model, opt = mixprec.prepare(model, opt, level=level)
        tokens = torch.randint(0, 256, (args.batch * world, args.seq + 1), generator=torch.Generator().manual_seed(0))
        x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=False)  # the gradients stay: a step's state, as training holds it
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
        out[level] = mixprec.memory_report(model, opt).to_dict()
    results[rank] = out
    if world > 1:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="world sizes (default 1,2,4)")
    parser.add_argument("--size", default="default", choices=["tiny", "quick", "default"])
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank (default 1)")
    parser.add_argument("--seq", type=int, default=8, help="tokens per sequence (default 8)")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.ranks.split(",")]
    by_world = {}
    for world in worlds:
        results = mp.get_context("spawn").Manager().dict()
        mp.start_processes(_worker, args=(world, _port(), results, args), nprocs=world, start_method="spawn")
        by_world[world] = [dict(results[r]) for r in range(world)]
        print(f"{world} rank(s) done", file=sys.stderr, flush=True)
    mib = 1 << 20
    print(f"Training state per rank, bench transformer ({args.size}), AdamW, after {args.steps} step(s); "
          "the largest rank, in MiB (parameters + masters + gradients + optimizer state):\n")  # fmt: skip
    print("| level | " + " | ".join(f"{w} rank{'s' if w > 1 else ''}" for w in worlds)
          + " | " + " | ".join(f"x{w} vs 1" for w in worlds if w > 1) + " | replicated (largest rank) |")  # fmt: skip
    print("|---|" + "---|" * (len(worlds) + len([w for w in worlds if w > 1]) + 1))
    one = {level: by_world[worlds[0]][0][level]["total"] for level in LEVELS} if worlds[0] == 1 else None
    for level in LEVELS:
        cells, ratios, replicated = [], [], 0
        for world in worlds:
            largest = max((r[level] for r in by_world[world]), key=lambda m: m["total"])
            cells.append(f"{largest['total'] / mib:.2f}")
            if world > 1:
                replicated = max(replicated, largest["replicated"])
                if one is not None:
                    # per-rank state against one process's divided by the world size (the target is <= 1.05)
                    ratios.append(f"{largest['total'] * world / one[level]:.3f}")
        print(f"| {level} | " + " | ".join(cells) + " | " + " | ".join(ratios) + f" | {replicated / 1024:.1f} KiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
