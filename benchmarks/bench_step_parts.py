"""Where a training step's time goes: forward, backward and ``optimizer.step()`` timed apart, per recipe.

The bench's step-cost model (``mixprec bench --step-cost``'s transformer) at ``--size``, each recipe (torch.amp's
autocast or ``mixprec.prepare`` at a level) with ``--optimizer``; the recipes take turns ``--block`` steps at a time
(a recipe's steps back to back: warm caches, unlike the bench's step-by-step interleaving), ``--rounds`` rounds. Prints
the median ms of each part and the whole step's ratio to torch.amp's (above 1: faster).

``--step-alone`` instead times ``optimizer.step()`` alone, repeated on one set of gradients, for each level and
state precision of ``--levels``: what the step's kernels cost without the forward and backward around them.

    python benchmarks/bench_step_parts.py --recipes torch-amp,O1,O2,bf16-pure
    python benchmarks/bench_step_parts.py --step-alone --size default --optimizer sgd --levels O1,bf16-pure,bf16-sr
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench import step_cost
from mixprec.bench.workloads import TinyLM


def _parts(recipes: list[str], optimizer: str, size: str, rounds: int, block: int) -> None:
    dim, batch_size, seq, blocks = step_cost._SIZES[size]
    inputs, targets = step_cost._batch(batch_size, seq)
    chosen = {r.name: r for r in step_cost.RECIPES}
    runs = [(chosen[name], *chosen[name].build(blocks, dim, optimizer)) for name in recipes]
    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "backward": [], "step": []} for name in recipes}
    for i in range(rounds):
        for recipe, model, opt in runs if i % 2 else runs[::-1]:
            for _ in range(block):
                opt.zero_grad(set_to_none=True)
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.level is None):
                    logits = model(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                forward = time.perf_counter()
                loss.backward()  # type: ignore[no-untyped-call]
                backward = time.perf_counter()
                opt.step()
                end = time.perf_counter()
                if i >= 1:  # the first round warms up (state made, kernels built)
                    part = times[recipe.name]
                    part["forward"].append(forward - start)
                    part["backward"].append(backward - forward)
                    part["step"].append(end - backward)
    medians = {name: {k: 1e3 * statistics.median(v) for k, v in parts.items()} for name, parts in times.items()}
    base = sum(medians[recipes[0]].values())
    print(f"{size} size, {optimizer}, {rounds - 1} rounds of {block} steps a recipe; ratio to {recipes[0]}")
    for name, parts in medians.items():
        whole = sum(parts.values())
        print(f"{name:>12}  " + "  ".join(f"{k} {v:.3f}" for k, v in parts.items()) + f"  ms  {base / whole:.3f}x")


def _step_alone(levels: list[str], states: list[str], optimizer: str, size: str, repeat: int) -> None:
    dim, batch_size, seq, blocks = step_cost._SIZES[size]
    inputs, targets = step_cost._batch(batch_size, seq)
    kind, options = step_cost.OPTIMIZERS[optimizer]
    print(f"{size} size, {optimizer}: optimizer.step() alone, median of {repeat}")
    for level in levels:
        for state in states:
            torch.manual_seed(0)
            model: torch.nn.Module = TinyLM(256, dim, blocks, heads=max(1, dim // 16))
            model, opt = mixprec.prepare(model, kind(model.parameters(), **options), level=level, optimizer_state=state)
            F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten()).backward()  # type: ignore[no-untyped-call]
            for _ in range(3):
                opt.step()
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
            print(f"{level:>10} {state:>5}  {1e3 * statistics.median(times):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="torch-amp,O1,O2,bf16-pure", help="the first is the baseline")
    parser.add_argument("--optimizer", default="adamw-fused", choices=list(step_cost.OPTIMIZERS))
    parser.add_argument("--size", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--step-alone", action="store_true")
    parser.add_argument("--levels", default="O1,O2,bf16-pure,bf16-sr,bf16-kahan")
    parser.add_argument("--states", default="fp32")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    if args.step_alone:
        _step_alone(args.levels.split(","), args.states.split(","), args.optimizer, args.size, args.repeat)
    else:
        _parts(args.recipes.split(","), args.optimizer, args.size, args.rounds, args.block)


if __name__ == "__main__":
    main()
