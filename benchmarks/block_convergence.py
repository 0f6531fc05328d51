"""Train two small language models in bf16, fp8, MXFP8 and NVFP4 (with its recipe's parts removed one at a time)
and with a per-layer plan; compare final losses with bf16's.

    python benchmarks/block_convergence.py --steps 300 --plot docs/images/block_convergence.png \\
        --json docs/images/block_convergence.json

Models: the bench's ``TinyLM`` (pre-norm transformer) and a config-built Hugging Face Llama, both on the
bench's second-order Markov source over 16 tokens (``markov_text``): the Llama learns its second-order table,
its loss falling through the 300 steps (2.8 to 1.7); TinyLM learns the first-order part (2.9 to 2.6) and
levels off. Every run of a model starts from the same weights and sees the same batches, at O1 (bf16
autocast, fp32 weights) with ``fp8=`` the recipe; "planned" is ``mixprec.tuning.plan_layers`` at its default
floor (20 dB) on the first batch, its block-scaled choices set on the model. The final loss is the mean loss
of four held-out batches after training (no gradient; the GEMMs in the run's formats). The block-scaled
GEMMs are emulated here (blocks dequantized, an fp32 GEMM): the seconds column is this CPU's emulation, not
a GPU's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import Progress
from torch import nn

import mixprec
from mixprec.bench.workloads import TinyLM, markov_text

SEQ, BATCH = 64, 16
VOCAB = 16  # the bench's second-order Markov source over 16 tokens: 256 contexts, 4 likely successors each
Batch = tuple[torch.Tensor, torch.Tensor]

#: run name -> the fp8 option of prepare (None: bf16 only); "planned" is handled apart
RUNS: dict[str, Any] = {
    "bf16": None,
    "fp8 tensorwise": "tensorwise",
    "mxfp8": "mxfp8",
    "nvfp4": mixprec.Fp8Config("nvfp4"),
    "nvfp4 without 16x16 weight tiles": mixprec.Fp8Config("nvfp4", tiles=False),
    "nvfp4 without the Hadamard transform": mixprec.Fp8Config("nvfp4", hadamard=False),
    "nvfp4 without stochastic rounding": mixprec.Fp8Config("nvfp4", stochastic_grads=False),
    "nvfp4 without bf16 last layers": mixprec.Fp8Config("nvfp4", keep_last=0.0),
    "planned": None,
}


@dataclasses.dataclass
class Model:
    name: str
    build: Callable[[], nn.Module]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _tinylm() -> nn.Module:
    return TinyLM(VOCAB, 128, 2, heads=4)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS = {
    "tinylm": Model("TinyLM (2 blocks, width 128)", _tinylm, lambda m, x: m(x)),
    "llama": Model("Llama (config-built: 2 layers, width 128)", _llama, lambda m, x: m(input_ids=x).logits),
}


def _batches(text: torch.Tensor, seed: int) -> Callable[[int], Batch]:
    def batch(step: int) -> Batch:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(text) - SEQ - 1, (BATCH,), generator=g)
        window = torch.stack([text[s : s + SEQ + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    return batch


def _loss(model: Model, net: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model.logits(net, batch[0])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())


def block_share(net: nn.Module, batch: Batch) -> float:
    """The share of the forward's layer GEMM FLOPs the model computes in a block-scaled format."""
    reach = mixprec.gemm_reach(net, batch[0])
    total = sum(layer.flops for layer in reach.layers) or 1
    block = {"nvfp4", "mxfp8"}
    return sum(layer.flops for layer in reach.layers if mixprec.layer_precision(net, layer.name) in block) / total


def train(model: Model, run: str, steps: int, on_step: Callable[[], None]) -> dict[str, Any]:
    torch.manual_seed(0)
    net = model.build()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    text = markov_text(200_000, VOCAB)
    batch, held_out = _batches(text, 0), _batches(text, 1)
    notes: list[str] = []
    plan = None
    if run == "planned":  # planned on the fp32 model, as tune plans
        plan = mixprec.tuning.plan_layers(net, batch(0)[0], lambda out: _loss_of_logits(out, batch(0)))
        notes = [f"{c.name}: {c.choice}" for c in plan.layers]
    net, optimizer = mixprec.prepare(net, optimizer, "O1", fp8=RUNS[run])
    for choice in plan.layers if plan is not None else ():
        if mixprec.LayerPrecision.from_name(choice.choice).block:
            mixprec.set_layer_precision(net, choice.name, choice.choice)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        loss = _loss(model, net, batch(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        on_step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        final = sum(float(_loss(model, net, held_out(i))) for i in range(4)) / 4
    return {"losses": losses, "final": final, "seconds": seconds, "share": block_share(net, batch(0)), "plan": notes}


def _loss_of_logits(out: Any, batch: Batch) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated run names (see RUNS)")
    parser.add_argument("--plot", help="write the loss curves to this PNG")
    parser.add_argument("--json", help="write every run's losses and figures to this JSON file")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--from-json", help="read the runs from this JSON file (of --json) instead of training")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [r for r in args.runs.split(",") if r]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        results, args.steps, runs, args.models = saved["results"], saved["steps"], [], ""
    with Progress() as progress:
        for key in [k for k in args.models.split(",") if k]:
            model = MODELS[key]
            results[key] = {}
            for run in runs:
                bar = progress.add_task(f"{key}: {run}", total=args.steps)
                results[key][run] = train(model, run, args.steps, lambda bar=bar: progress.advance(bar))
    for key, by_run in results.items():
        base = by_run["bf16"]["final"] if "bf16" in by_run else None
        print(f"\n{MODELS[key].name}, {args.steps} steps of {BATCH}x{SEQ} tokens; held-out loss after training")
        print("| run | final loss | vs bf16 | GEMM FLOPs block-scaled | seconds (this CPU, block GEMMs emulated) |")
        print("|---|---:|---:|---:|---:|")
        for run, r in by_run.items():
            diff = "" if base is None or run == "bf16" else f"{(r['final'] - base) / base:+.2%}"
            print(f"| {run} | {r['final']:.4f} | {diff} | {r['share']:.0%} | {r['seconds']:.0f} |")
        if "planned" in by_run:
            print("plan: " + ", ".join(by_run["planned"]["plan"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"steps": args.steps, "results": results}, fh)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 7.5), squeeze=False)
        for column, (key, by_run) in enumerate(results.items()):
            top, bottom = axes[0][column], axes[1][column]
            base = torch.tensor(by_run["bf16"]["losses"]) if "bf16" in by_run else None
            for index, (run, r) in enumerate(by_run.items()):
                color = f"C{index}"  # a run's colour is the same in both rows
                losses = torch.tensor(r["losses"])
                smooth = losses.unfold(0, 20, 1).mean(1)
                steps = range(19, 19 + len(smooth))
                top.plot(steps, smooth, label=run, linewidth=1, color=color)
                if base is not None and run != "bf16":
                    gap = ((losses - base) / base).unfold(0, 20, 1).mean(1) * 100
                    bottom.plot(steps, gap, label=run, linewidth=1, color=color)
            top.set(xlabel="step", ylabel="training loss (mean of 20 steps)", title=MODELS[key].name)
            top.legend(fontsize=7)
            bottom.axhline(0, color="black", linewidth=0.5)
            bottom.set(xlabel="step", ylabel="% above bf16's loss (mean of 20 steps)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
