"""Memory per recipe: bytes per parameter (memory_report and the process's peak), speed, and loss against fp32.

Each recipe is a prepare level with an optimizer-state precision and, optionally, the step in
backward. Three measurements per recipe, each in processes of its own:

* **bytes per parameter**: ``mixprec.memory_report`` after a step (weights, masters, gradients,
  optimizer state), and the process's peak resident memory over three training steps at a batch of one
  sequence (so activations are a sliver), less the process's memory before the model was built
  (after a warm-up run of the same recipe on a model of the same shapes, since freed, so kernels
  compiled, libraries loaded and caches filled once do not count; with the data the steps feed from
  already built: the MLP's teacher, the token stream), divided by the parameter count.
  glibc is told to give large blocks back (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the
  resident set.
* **the plan**: ``mixprec.memory_plan``'s prediction of both, from the shapes alone; and the peak less
  the activations that sequence saves for backward (the plan's count of them, byte-exact against the
  real forward's), i.e. weights, gradients and optimizer state with activations aside.
* **speed**: median wall time of a training step (forward, backward, step) at the workload's batch,
  against bf16-pure's in the same run (a ratio from one run; the machine is shared and noisy), with
  glibc's own settings.
* **loss**: the mean loss of the last fifth of ``--steps`` steps, against plain fp32 AdamW's, on the
  same data from the same weights; ``--plot`` draws the curves.

    python benchmarks/bench_bytes_per_param.py                              # the Markdown tables
    python benchmarks/bench_bytes_per_param.py --loss-size quick --steps 300 --plot docs/images/memory_loss.png
    python benchmarks/bench_bytes_per_param.py --peak-only          # the bytes alone
    python benchmarks/bench_bytes_per_param.py --loss-only --plot docs/images/memory_loss.png
    python benchmarks/bench_bytes_per_param.py --speed-only --rounds 3   # the speed alone, recipes in turn
    python benchmarks/bench_bytes_per_param.py --speed-only --interleaved --recipes bf16-pure,"bf16-sr 8bit"
    python benchmarks/bench_bytes_per_param.py --peak-only --workloads hf-gpt2,hf-llama   # config-built HF models
    python benchmarks/bench_bytes_per_param.py --speed-only --paired --rounds 3 --recipes "bf16-sr 8bit"
    python benchmarks/bench_bytes_per_param.py --device cuda --peak-only    # on a GPU: the allocator's peak

On a CUDA device the peak is the caching allocator's (``torch.cuda.max_memory_allocated``: the bytes of
live tensors, exact) over the same three steps, less what was allocated before the model was built, and
each timed step ends with a synchronize.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.bench.workloads import WORKLOADS

#: where the models train (``--device``; the children are told it too)
DEVICE = torch.device("cpu")

#: name -> prepare options (None: plain fp32 AdamW, no prepare)
RECIPES: dict[str, dict[str, Any] | None] = {
    "fp32 AdamW": None,
    "O1": {"level": "O1"},
    "O2": {"level": "O2"},
    "bf16-pure": {"level": "bf16-pure"},
    "bf16-sr": {"level": "bf16-sr"},
    "bf16-kahan": {"level": "bf16-kahan"},
    "O2 bf16": {"level": "O2", "optimizer_state": "bf16"},
    "bf16-pure bf16": {"level": "bf16-pure", "optimizer_state": "bf16"},
    "bf16-sr 8bit": {"level": "bf16-sr", "optimizer_state": "8bit"},
    "bf16-sr fp8": {"level": "bf16-sr", "optimizer_state": "fp8"},
    "bf16-sr 8bit in-backward": {"level": "bf16-sr", "optimizer_state": "8bit", "step_in_backward": True},
    "bf16-sr fp8 in-backward": {"level": "bf16-sr", "optimizer_state": "fp8", "step_in_backward": True},
    "bf16-sr 4bit in-backward": {"level": "bf16-sr", "optimizer_state": "4bit", "step_in_backward": True},
    "bf16-pure 8bit in-backward": {"level": "bf16-pure", "optimizer_state": "8bit", "step_in_backward": True},
    "bf16-kahan 8bit in-backward": {"level": "bf16-kahan", "optimizer_state": "8bit", "step_in_backward": True},
}


class _Logits(nn.Module):
    """A Hugging Face causal LM as ``tokens -> logits`` (its parameters are the model's)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm(input_ids=tokens).logits
        return logits


def _hf_task(name: str, size: str) -> Any:
    """A config-built Hugging Face causal LM (GPT-2's or Llama's architecture) on generated Markov text, as a
    bench workload: ``hf-gpt2`` (50M parameters at the default size), ``hf-llama`` (47M)."""
    import transformers  # only for these workloads

    from mixprec.bench.workloads import Task, markov_text

    dim, layers, seq, batch = (1024, 4, 128, 8) if size == "default" else (256, 2, 64, 8)
    vocab = 4096
    torch.manual_seed(0)
    if name == "hf-gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers,
                                         n_head=dim // 64, bos_token_id=0, eos_token_id=0)  # fmt: skip
        lm = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 11 // 4,
                                          num_hidden_layers=layers, num_attention_heads=dim // 64,
                                          num_key_value_heads=dim // 256, max_position_embeddings=seq)  # fmt: skip
        lm = transformers.LlamaForCausalLM(config)
    lm.to(DEVICE)
    text = markov_text(50_000, vocab=vocab)

    def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=torch.Generator().manual_seed(step))
        window = torch.stack([text[s : s + seq + 1] for s in starts.tolist()])
        return window[:, :-1].to(DEVICE), window[:, 1:].to(DEVICE)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Task(_Logits(lm), batch_fn, loss_fn, lr=1e-3)


def _task(workload: str, size: str) -> Any:
    """The bench's workload, or a config-built Hugging Face model (``hf-gpt2``, ``hf-llama``)."""
    if workload.startswith("hf-"):
        return _hf_task(workload, size)
    task = WORKLOADS[workload].build(size, DEVICE)
    task.model.to(DEVICE)
    return task


_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def build(workload: str, size: str, recipe: str) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    task = _task(workload, size)
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.01)
    options = RECIPES[recipe]
    if options is not None:
        options = dict(options)
        mixprec.prepare(model, optimizer, options.pop("level"), **options)
    return task, model, optimizer


def train_step(task: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               rows: int | None = None, batch: Any = None) -> float:  # fmt: skip
    x, y = task.batch(step) if batch is None else batch
    if rows is not None:
        x, y = x[:rows], y[:rows]
    optimizer.zero_grad()
    loss = task.loss_fn(model(x).float(), y)
    loss.backward()
    optimizer.step()
    value = float(loss.detach())
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)  # the step too, not only the loss
    return value


def _resident(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_worker(workload: str, size: str, recipe: str) -> dict[str, float]:
    """In a process of its own: bytes per parameter by memory_report and by the resident peak."""
    warm = build(workload, size, recipe)  # the same shapes: kernels, caches and code made once are in the base
    for step in range(2):
        train_step(*warm, step, rows=1)
    del warm
    # The data the steps feed from (the MLP's teacher, the transformer's token stream) is the bench's, not the
    # model's: built before the base, its model dropped. Each batch is one row, copied (a view would keep the
    # whole batch alive).
    task = _task(workload, size)
    fp32_model = task.model
    task.model = nn.Identity()
    x, y = (t[:1].clone() for t in task.batch(0))
    batches = [tuple(t[:1].clone() for t in task.batch(step)) for step in range(3)]
    options = RECIPES[recipe]
    config: Any = "fp32" if options is None else mixprec.PrepareConfig(**options)
    plan = mixprec.memory_plan(fp32_model, torch.optim.AdamW(fp32_model.parameters()), config, batch=x,
                               loss_fn=lambda out: task.loss_fn(out.float(), y))  # fmt: skip
    del fp32_model
    gc.collect()
    cuda = DEVICE.type == "cuda"
    base = torch.cuda.memory_allocated(DEVICE) if cuda else _resident("VmRSS")
    built, model, optimizer = build(workload, size, recipe)
    del built  # its own copy of the data
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats(DEVICE)
    else:
        with open("/proc/self/clear_refs", "w") as refs:  # the peak from here on
            refs.write("5")
    for step in range(3):
        train_step(task, model, optimizer, step, batch=batches[step])
    peak = torch.cuda.max_memory_allocated(DEVICE) if cuda else _resident("VmHWM")
    report = mixprec.memory_report(model, optimizer)
    return {"params": params, "report": report.total / params, "peak": (peak - base) / params,
            "activations": (plan.activations or 0) / params,
            "state": report.optimizer_state / params, "gradients": report.gradients / params,
            "plan_state": plan.state / params, "plan_peak": (plan.peak or 0) / params}  # fmt: skip


def speed(workload: str, size: str, recipe: str, steps: int) -> float:
    """Median seconds of a training step at the workload's batch (after two warm-up steps)."""
    task, model, optimizer = build(workload, size, recipe)
    times = []
    for step in range(steps + 2):
        begin = time.perf_counter()
        train_step(task, model, optimizer, step)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[2:])


def losses(workload: str, size: str, recipe: str, steps: int) -> list[float]:
    task, model, optimizer = build(workload, size, recipe)
    return [train_step(task, model, optimizer, step) for step in range(steps)]


def _in_child(*args: str) -> dict[str, Any]:
    # glibc's setting for the peak only: handing every large block back to the system makes each step's
    # allocations page faults (measured: the MLP's step 25% slower), which no training run pays
    env = {**os.environ, **_MMAP} if args[0] == "peak" else dict(os.environ)
    command = [sys.executable, __file__, "--device", str(DEVICE), "--child", *args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="transformer,mlp")
    parser.add_argument("--size", default="default", help="size of the memory and speed runs")
    parser.add_argument("--loss-size", default="quick", help="size of the loss runs")
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss runs")
    parser.add_argument("--speed-steps", type=int, default=6)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--plot", default=None, help="draw the loss curves into this PNG")
    parser.add_argument("--peak-only", action="store_true", help="only the bytes (no speed or loss runs)")
    parser.add_argument("--loss-only", action="store_true", help="only the loss runs and the plot (a JSON of the "
                        "curves beside it)")  # fmt: skip
    parser.add_argument("--speed-only", action="store_true", help="only the speed runs")
    parser.add_argument("--rounds", type=int, default=1, help="speed runs per recipe, taken in turns (the fastest "
                        "of each recipe's counts: the machine's noise only ever slows a run down)")  # fmt: skip
    parser.add_argument("--interleaved", action="store_true", help="with --speed-only: every recipe in one process, "
                        "a step of each in turn (the same machine state for all: steadier ratios; every model "
                        "is held at once)")  # fmt: skip
    parser.add_argument("--paired", action="store_true", help="with --speed-only: each recipe beside bf16-pure alone "
                        "in a process of its own, a step of each in turn; --rounds such processes a recipe, taken in "
                        "turns: the median ratio and its range (one model in company, as training runs)")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="where the models train (cpu, cuda)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    warnings.filterwarnings("ignore")
    if args.child:
        kind, workload, size, recipe, steps = args.child
        if kind == "peak":
            result: Any = peak_worker(workload, size, recipe)
        elif kind == "speed":
            result = speed(workload, size, recipe, int(steps))
        elif kind == "pair":
            result = paired_ratio(workload, size, recipe, int(steps))
        else:
            result = losses(workload, size, recipe, int(steps))
        print(json.dumps(result))
        return
    recipes = args.recipes.split(",")
    if args.speed_only and args.paired:
        _paired(args.workloads.split(","), args.size, [r for r in recipes if r != "bf16-pure"], args.speed_steps,
                args.rounds)  # fmt: skip
        return
    if args.speed_only and args.interleaved:
        for workload in args.workloads.split(","):
            _interleaved(workload, args.size, recipes, args.speed_steps)
        return
    if args.speed_only:
        _speeds(args.workloads.split(","), args.size, recipes, args.speed_steps, args.rounds)
        return
    curves: dict[str, dict[str, list[float]]] = {}
    from rich.progress import track

    for workload in args.workloads.split(","):
        rows = []
        for recipe in track(recipes, description=f"{workload}", transient=True, console=None):
            if args.loss_only:
                rows.append((recipe, {}, 0.0, _in_child("loss", workload, args.loss_size, recipe, str(args.steps))))
                continue
            peak = _in_child("peak", workload, args.size, recipe, "0")
            if args.peak_only:
                aside = peak["peak"] - peak["activations"]
                print(f"| {workload} | {recipe} | {peak['report']:.2f} | {peak['plan_state']:.2f} | {peak['peak']:.2f} "
                      f"| {aside:.2f} | {peak['plan_peak']:.2f} |", flush=True)  # fmt: skip
                continue
            seconds = _in_child("speed", workload, args.size, recipe, str(args.speed_steps))
            curve = _in_child("loss", workload, args.loss_size, recipe, str(args.steps))
            rows.append((recipe, peak, seconds, curve))
        if args.peak_only:
            continue
        curves[workload] = {recipe: curve for recipe, _, _, curve in rows}
        if args.loss_only:
            continue
        pure = next(seconds for recipe, _, seconds, _ in rows if recipe == "bf16-pure")
        tail = max(1, args.steps // 5)
        fp32 = statistics.mean(rows[0][3][-tail:])
        print(f"\n{workload} ({rows[0][1]['params'] / 1e6:.1f}M parameters at size {args.size}; loss at size "
              f"{args.loss_size}, {args.steps} steps)\n")  # fmt: skip
        print("| recipe | bytes/param (memory_report) | of which state | memory_plan | bytes/param (peak, 1 "
              "sequence) | peak less activations | memory_plan's peak | step vs bf16-pure | final loss | "
              "vs fp32 AdamW |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for recipe, peak, seconds, curve in rows:
            final = statistics.mean(curve[-tail:])
            aside = peak["peak"] - peak["activations"]
            print(f"| {recipe} | {peak['report']:.2f} | {peak['state']:.2f} | {peak['plan_state']:.2f} | "
                  f"{peak['peak']:.2f} | {aside:.2f} | {peak['plan_peak']:.2f} | {pure / seconds:.2f}x | {final:.4f} | "
                  f"{(final - fp32) / fp32:+.2%} |")  # fmt: skip
    if args.plot:
        _plot(curves, args.plot)
        with open(os.path.splitext(args.plot)[0] + ".json", "w") as out:
            json.dump(curves, out)


def _speeds(workloads: list[str], size: str, recipes: list[str], steps: int, rounds: int) -> None:
    """Each recipe's step against bf16-pure's; every round runs every recipe once, in turn."""
    seconds = _child_rounds("speed", workloads, size, recipes, steps, rounds)
    print("| workload | recipe | step (ms) | step vs bf16-pure |\n|---|---|---|---|")
    for workload in workloads:
        pure = min(seconds[workload, "bf16-pure"])
        for recipe in recipes:
            best = min(seconds[workload, recipe])
            print(f"| {workload} | {recipe} | {best * 1e3:.1f} | {pure / best:.2f}x |")


def _child_rounds(kind: str, workloads: list[str], size: str, recipes: list[str], steps: int,
                  rounds: int) -> dict[tuple[str, str], list[float]]:  # fmt: skip
    """``kind``'s figure of each (workload, recipe), each in a process of its own: every round runs every one
    once, in turn."""
    from rich.progress import track

    runs = [(workload, recipe) for _ in range(rounds) for workload in workloads for recipe in recipes]
    figures: dict[tuple[str, str], list[float]] = {}
    for workload, recipe in track(runs, description=kind, transient=True):
        figures.setdefault((workload, recipe), []).append(_in_child(kind, workload, size, recipe, str(steps)))
    return figures


def paired_ratio(workload: str, size: str, recipe: str, steps: int) -> float:
    """In a process of its own: bf16-pure's median step over ``recipe``'s, the two built here and stepped in turn."""
    pure, mine = _in_turn([build(workload, size, "bf16-pure"), build(workload, size, recipe)], steps)
    return pure / mine


def _paired(workloads: list[str], size: str, recipes: list[str], steps: int, rounds: int) -> None:
    """Each recipe's speed against bf16-pure's, paired in processes of two models, ``rounds`` processes each."""
    ratios = _child_rounds("pair", workloads, size, recipes, steps, rounds)
    print("| workload | recipe | step vs bf16-pure, median | range | processes |\n|---|---|---|---|---|")
    for workload in workloads:
        for recipe in recipes:
            got = ratios[workload, recipe]
            print(f"| {workload} | {recipe} | {statistics.median(got):.3f}x | {min(got):.3f}-{max(got):.3f}x | "
                  f"{len(got)} |")  # fmt: skip


def _interleaved(workload: str, size: str, recipes: list[str], steps: int) -> None:
    """Each recipe's median step against the first recipe's, all built in this process and stepped in turn."""
    medians = _in_turn([build(workload, size, recipe) for recipe in recipes], steps, progress=workload)
    print(f"| workload | recipe | step (ms) | step vs {recipes[0]} |\n|---|---|---|---|")
    for recipe, median in zip(recipes, medians, strict=True):
        print(f"| {workload} | {recipe} | {median * 1e3:.1f} | {medians[0] / median:.2f}x |")


def _in_turn(runs: list[Any], steps: int, progress: str | None = None) -> list[float]:
    """Each built run's median training step (after two warm-up steps), the runs stepped in turn."""
    from rich.progress import track

    seconds: list[list[float]] = [[] for _ in runs]
    count = range(steps + 2)
    for step in count if progress is None else track(count, description=progress, transient=True):
        for times, (task, model, optimizer) in zip(seconds, runs, strict=True):
            begin = time.perf_counter()
            train_step(task, model, optimizer, step)
            times.append(time.perf_counter() - begin)
    return [statistics.median(times[2:]) for times in seconds]


def _plot(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    """Per workload: the loss curves, and below them each recipe's loss against fp32 AdamW's (10-step means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(6.5 * len(curves), 8), squeeze=False)
    for column, (workload, by_recipe) in enumerate(curves.items()):
        smooth = {r: [statistics.mean(c[max(0, i - 9) : i + 1]) for i in range(len(c))] for r, c in by_recipe.items()}
        reference = smooth.get("fp32 AdamW")
        for recipe, curve in smooth.items():
            width = 2.0 if recipe == "fp32 AdamW" else 1.0
            axes[0][column].plot(curve, label=recipe, linewidth=width)
            if reference is not None:
                apart = [100 * (a - b) / b for a, b in zip(curve, reference, strict=True)]
                axes[1][column].plot(apart, label=recipe, linewidth=width)
        axes[0][column].set_title(f"{workload}: loss (10-step mean)")
        axes[1][column].set_title(f"{workload}: loss against fp32 AdamW's (%)")
        axes[1][column].set_xlabel("step")
        axes[1][column].axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
        axes[1][column].axhline(-1.0, color="grey", linestyle=":", linewidth=0.8)
        axes[0][column].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
