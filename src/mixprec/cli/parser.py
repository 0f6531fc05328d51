"""The ``mixprec`` command's arguments: one subparser per subcommand."""

from __future__ import annotations

import argparse

import torch

from mixprec.bench.modes import MODES
from mixprec.bench.runner import COMPILE_MODES, DEFAULT_MODES
from mixprec.bench.workloads import SIZES, WORKLOADS
from mixprec.cli import common

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixprec", description="Mixed-precision training tools for PyTorch.")
    from mixprec import __version__

    parser.add_argument("--version", action="version", version=f"mixprec {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="train each workload in fp32, torch.amp and mixprec modes side by side",
        description="Train each workload in each mode on this machine and report steps/s, speed-ups, peak "
        "memory and final loss; writes report.json, report.md and bench.png.",
    )
    bench.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="smaller workloads and fewer steps (about a minute)",
    )
    bench.add_argument("--steps", type=int, help="training steps per run (default: by size)")
    bench.add_argument(
        "--workloads",
        type=lambda t: common.names(t, list(WORKLOADS), "workload"),
        default=tuple(WORKLOADS),
        help=f"comma-separated; default all: {','.join(WORKLOADS)}",
    )
    bench.add_argument(
        "--modes",
        type=lambda t: common.names(t, list(MODES), "mode"),
        help=f"comma-separated; default {','.join(DEFAULT_MODES)} (with --compile: fp32 and "
        f"{','.join(COMPILE_MODES)}); available: {','.join(MODES)}",
    )
    bench.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    bench.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16"],
        help="auto: bf16 where it is fast, else fp16 on CUDA; fp16 runs use a GradScaler",
    )
    bench.add_argument("--size", choices=SIZES, help="workload size (overrides --quick)")
    bench.add_argument(
        "--tune-budget",
        type=float,
        default=60.0,
        help="seconds mixprec.tune may take per workload for mixprec-tuned (default 60)",
    )
    bench.add_argument("--out", default="mixprec-bench", help="output folder (default ./mixprec-bench/)")
    bench.add_argument("--json", help="also write the JSON report here")
    bench.add_argument(
        "--quiet",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no progress bars: one log line per result (so too when stdout is not a terminal)",
    )
    bench.add_argument(
        "--nproc",
        type=int,
        help="train under FSDP2 (fully_shard) over N processes on this machine, each prepare level beside torch's "
        "own FSDP2 mixed precision and one process (gloo on CPU, NCCL on CUDA); default workload: transformer",
    )
    bench.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also train modes as torch.compile(model) and report them against eager and against compiled "
        f"torch-amp: every mode of --modes, or without --modes fp32 eager and {','.join(COMPILE_MODES)} "
        "eager and compiled; also counts inductor's kernels per fp8 linear against torchao's (compiling takes "
        "minutes on a CPU)",
    )
    bench.add_argument(
        "--compile-modes",
        type=lambda t: common.names(t, list(MODES), "mode"),
        help="the modes to compile (implies --compile; each also trains eagerly)",
    )
    bench.add_argument(
        "--memory-budget",
        help="also print the memory table: per mode, bytes a parameter of the bench transformer, its "
        "predicted peak, the largest bench transformer fitting this budget (e.g. 4GiB) and the "
        "final loss against fp32 (memory_plan: nothing more is trained)",
    )
    bench.add_argument(
        "--step-cost",
        action="store_true",
        help="instead of training the workloads, print what a training step costs at each level and "
        "optimizer-state precision, with each form of AdamW and with SGD: optimizer.step()'s ops at 2 "
        "and 8 blocks of a small transformer, host reads in a whole step, step time against torch.amp "
        "(--size tiny or quick: width 64, overhead-bound; default: width 256), on --device; with "
        "--compile also the compiled step of each recipe against compiled torch.amp",
    )
    bench.add_argument(
        "--llama",
        action="store_true",
        help="instead of training the workloads, train a config-built Hugging Face Llama (--size default: 1.1B "
        "parameters at sequence 2048; quick: 0.2B at 1024; tiny: a CPU smoke test) at each level, torch.amp's "
        "autocast and fp8 linears, and print tokens/s, the ratio to torch.amp (fp8: to O1), the bytes held "
        "and CUDA's peak memory; with --compile also each compiled; --steps timed steps (default 5)",
    )
    bench.add_argument(
        "--batch",
        type=int,
        help="with --llama: the batch (default: on CUDA the largest of 16, 8, 4, 2, 1 that fits; else the size's)",
    )
    bench.add_argument(
        "--recipes",
        help="with --step-cost or --llama: only these recipes, comma-separated (e.g. O2,bf16-sr; the baseline, "
        "torch-amp, always); fewer models interleaved, steadier ratios",
    )
    bench.add_argument(
        "--fp8-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --compile: count inductor's kernels per fp8 linear, mixprec against torchao (default on)",
    )

    diagnose = sub.add_parser(
        "diagnose",
        help="find where low precision breaks a model (overflow, underflow, NaN), and what to do",
        description="Run a model forward and backward in fp32 and in fp16/bf16, and report per module the "
        "value ranges against the dtype, NaN/Inf, the first non-finite op, modules to keep in fp32 and a loss scale.",
    )
    common.add_target_arguments(diagnose, "a bench workload (tiny size)", ", as diagnose(targets=)")
    diagnose.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    diagnose.add_argument("--policy", help="the autocast policy to check, e.g. cpu, cuda, 'compute=fp16,keep=norm'")
    diagnose.add_argument(
        "--fp8",
        choices=["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"],
        help="also report per fp8 layer its SQNR, saturation and flush-to-zero",
    )
    diagnose.add_argument("--out", default="mixprec-diagnose", help="folder for report.json and diagnose.png")

    tune = sub.add_parser(
        "tune",
        help="find the fastest precision recipe for a model that keeps its accuracy, measured here",
        description="Time candidate recipes (dtype, ops moved to fp32, memory layout, prepare level) on the model "
        "and batch, keep those whose first steps stay within tolerance of fp32, plan each GEMM layer's "
        "precision (linears, Conv1D, attention projections, convolutions), and print the tables; --out "
        "writes the recipe as JSON for mixprec.Recipe.from_json.",
    )
    common.add_target_arguments(tune, "a bench workload", "")
    tune.add_argument("--size", choices=SIZES, default="default", help="--workload's size (default: default)")
    tune.add_argument("--budget", type=float, default=60.0, help="seconds the search may take (default 60)")
    tune.add_argument("--dtypes", default="bf16,fp16,fp32", help="compute dtypes to search (default bf16,fp16,fp32)")
    tune.add_argument("--levels", default="O2,bf16-sr", help="prepare levels to search besides O1 (default O2,bf16-sr)")
    tune.add_argument(
        "--no-per-layer",
        dest="per_layer",
        action="store_false",
        help="no per-layer plan (each layer timed and checked in each precision)",
    )
    tune.add_argument(
        "--layer-sqnr-db",
        type=float,
        default=20.0,
        help="a layer's SQNR floor against fp32 for the per-layer plan (default 20)",
    )
    tune.add_argument(
        "--memory-budget",
        help="the most a rank may hold at its peak (e.g. 4GiB): only recipes "
        "mixprec.memory_plan predicts within it are chosen",
    )
    tune.add_argument("--out", help="write the recipe here as JSON")

    plan = sub.add_parser(
        "memory-plan",
        help="predict the bytes per rank a recipe will hold (weights, masters, gradients, state, activations)",
        description="Predict from the model's shapes alone (fake tensors: nothing is allocated or run) what "
        "mixprec.memory_report will count after a step, and the activations one forward saves, with and without "
        "activation checkpointing of the model's blocks.",
    )
    common.add_target_arguments(plan, "a bench workload", "")
    plan.add_argument("--size", choices=SIZES, default="default", help="--workload's size (default: default)")
    plan.add_argument("--level", default="O2", choices=["O1", "O2", "bf16-sr", "bf16-kahan", "bf16-pure"])
    plan.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    plan.add_argument("--optimizer-state", default="fp32", choices=["fp32", "bf16", "8bit", "4bit", "fp8"])
    plan.add_argument("--step-in-backward", action="store_true", help="step each parameter in backward")
    plan.add_argument("--world-size", type=int, default=1, help="FSDP2 ranks (default 1)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    policy = sub.add_parser("policy", help="print a precision policy's op lists")
    policy.add_argument(
        "spec", nargs="?", default="cpu", help="a policy name or string, e.g. cpu, cuda, 'compute=bf16'"
    )
    return parser
