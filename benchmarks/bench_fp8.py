"""What fp8 linears buy over bf16: per GEMM shape, and per training step of the bench's transformer.

1. One linear layer, forward and backward (its three GEMMs): an ``nn.Linear(K, N, bias=False)``
   with bf16 weights on a bf16 input of M tokens, plain, and converted to fp8 with each recipe
   (``fp8_conversion.convert``, the head included). Delayed scaling's history is filled once in warm-up.
2. Training steps (AdamW) of the bench's ``transformer`` workload under ``mixprec.prepare(model,
   opt, "O1", fp8=recipe)`` against ``mixprec.prepare(model, opt, "O1")`` (bf16 only).

Modes alternate window by window in rotating order in one process; a time is the median window
(CUDA events on a GPU), a speed-up the median over rounds of bf16's time / fp8's (>1: fp8 faster).
On a CPU ``torch._scaled_mm`` emulates fp8 in fp32: the times there only show that the script runs.
Run: python benchmarks/bench_fp8.py [--quick] [--device cuda] [--recipes tensorwise,delayed] [--json F]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
from torch import nn

import mixprec
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8 import fused_cast
from mixprec.bench.runner import make_optimizer
from mixprec.bench.workloads import WORKLOADS, Task

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
FUSED = ("tensorwise", "delayed")  # the recipes whose casts the fused fp8 cast makes on CUDA (tensorwise scales)
Shape = tuple[int, int, int]
SHAPES: dict[tuple[str, bool], tuple[Shape, ...]] = {  # (device type, quick) -> (M, K, N) of each linear
    ("cuda", False): ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 4096, 14336), (2048, 1024, 1024),
                      (1024, 256, 256)),
    ("cuda", True): ((2048, 2048, 2048), (4096, 4096, 4096)),
    ("cpu", False): ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024)),
    ("cpu", True): ((256, 256, 256), (512, 512, 512)),
}  # fmt: skip
#: a mode's suffix: the recipe with the ATen ops' casts (``--aten-casts``; on CUDA the fused cast's otherwise)
ATEN = " (ATen casts)"
CPU_NOTE = "fp8 GEMMs are emulated in fp32 on a CPU (torch._scaled_mm): these times say nothing about GPU speed"


@dataclasses.dataclass
class GemmRow:
    m: int
    k: int
    n: int
    ms: dict[str, float]  # median forward+backward per mode ("bf16" and each recipe that ran)
    speedup: dict[str, float]  # per recipe: median over rounds of bf16's time / the recipe's (>1: faster)
    tflops: dict[str, float]  # per mode: 6*M*K*N flops (three GEMMs) over the median time
    errors: dict[str, str]  # per recipe that could not run: why


@dataclasses.dataclass
class StepRow:
    workload: str
    size: str
    ms: dict[str, float]  # median training step per mode
    speedup: dict[str, float]
    converted: dict[str, int]  # per recipe: linears in fp8 (and left out, below)
    skipped: dict[str, int]
    last_loss: dict[str, float]
    errors: dict[str, str]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        model = "unknown"
    return f"CPU {model}, {torch.get_num_threads()} threads"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _window(fn: Callable[[], None], calls: int, device: torch.device) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / calls
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) * 1e3 / calls


def lockstep(fns: dict[str, Callable[[], None]], windows: int, calls: int,
             device: torch.device) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Median ms per call of each fn, and the median per-round ratio of the first fn's time to each one's."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    _sync(device)
    for w in range(windows):
        for name in names[w % len(names) :] + names[: w % len(names)]:  # each mode first equally often
            times[name].append(_window(fns[name], calls, device))
    ref = times[names[0]]
    ms = {name: statistics.median(t) for name, t in times.items()}
    return ms, {name: statistics.median(r / t for r, t in zip(ref, ts, strict=True)) for name, ts in times.items()}


def _fwd_bwd(layer: nn.Linear, called: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        layer.weight.grad = x.grad = None
        called(x).backward(grad)

    return run


def _train_step(task: Task, model: nn.Module, optimizer: torch.optim.Optimizer,
                losses: list[torch.Tensor]) -> Callable[[], None]:  # fmt: skip
    def step() -> None:
        inputs, targets = task.batch(len(losses))
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.detach())

    return step


def _recipe(mode: str) -> str:
    return mode.removesuffix(ATEN)


def _casts_as_asked(mode: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, with the fused fp8 cast off while it runs where ``mode`` asks for the ATen ops' casts."""
    if not mode.endswith(ATEN):
        return fn

    def run() -> None:
        with mock.patch.dict(os.environ, {fused_cast.ENV: "0"}):
            fn()

    return run


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def bench_gemm(shape: Shape, recipes: list[str], device: torch.device, compile: bool, windows: int,
               calls: int, profile: bool = False) -> GemmRow:  # fmt: skip
    m, k, n = shape
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    fns: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    for mode in ("bf16", *recipes):
        layer = copy.deepcopy(base)
        try:
            layers = None
            if mode != "bf16":
                config = mixprec.Fp8Config(mixprec.Fp8Recipe(_recipe(mode)), convert_head=True)
                layers = fp8_conversion.convert(layer, config, set())
            called: nn.Module = torch.compile(layer) if compile else layer  # type: ignore[assignment]
            fn = _casts_as_asked(mode, _fwd_bwd(layer, called, x, grad))
            for _ in range(3):  # warm-up (and compilation); delayed scaling: a history to scale from
                fn()
                if layers is not None:
                    fp8_conversion.advance(layers)
            fns[mode] = fn
        except Exception as exc:  # a recipe this GPU lacks, a compile failure: reported, the rest goes on
            if mode == "bf16":
                raise
            errors[mode] = _error(exc)
    ms, ratios = lockstep(fns, windows, calls, device)
    if profile:
        for mode, fn in fns.items():
            print(host_and_device(mode, fn, device))
    flops = 6.0 * m * k * n
    tflops = {mode: flops / (t * 1e-3) / 1e12 for mode, t in ms.items()}
    return GemmRow(m, k, n, ms, {r: ratios[r] for r in recipes if r in ratios}, tflops, errors)


def host_and_device(mode: str, fn: Callable[[], None], device: torch.device) -> str:
    """One call of ``fn`` taken apart: the host's time to issue it (no wait), the device's kernels (count, summed
    time) and the five longest, from torch's profiler: whether a mode is bound by its launches or its kernels."""
    from mixprec._src import profiling

    _sync(device)
    begin = time.perf_counter()
    fn()
    host_us = (time.perf_counter() - begin) * 1e6
    _sync(device)

    def call() -> None:
        fn()
        _sync(device)

    prof = profiling.profiled(call, cuda=device.type == "cuda")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    longest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:5]
    lines = [f"    {mode}: host {host_us:.0f} us to issue; device {total:.0f} us in {len(kernels)} kernels"]
    lines += [f"      {sum(t):8.1f} us  x{len(t):<3} {name[:90]}" for name, t in longest]
    return "\n".join(lines)


def bench_steps(recipes: list[str], device: torch.device, size: str, steps: int, compile: bool) -> StepRow:
    fns: dict[str, Callable[[], None]] = {}
    losses: dict[str, list[torch.Tensor]] = {}
    converted: dict[str, int] = {}
    skipped: dict[str, int] = {}
    errors: dict[str, str] = {}
    for mode in ("bf16", *recipes):
        task = WORKLOADS["transformer"].build(size, device)  # seeded: the same model and data in every mode
        model = task.model.to(device)
        try:
            optimizer = make_optimizer(task, model.parameters())
            model, optimizer = mixprec.prepare(model, optimizer, "O1", fp8=None if mode == "bf16" else _recipe(mode))
            if (layers := mixprec.fp8_layers(model)) is not None:
                converted[mode], skipped[mode] = len(layers.converted), len(layers.skipped)
            called: nn.Module = torch.compile(model) if compile else model  # type: ignore[assignment]
            step = _casts_as_asked(mode, _train_step(task, called, optimizer, losses.setdefault(mode, [])))
            for _ in range(2):  # warm-up (and compilation)
                step()
            fns[mode] = step
        except Exception as exc:
            if mode == "bf16":
                raise
            errors[mode] = _error(exc)
    ms, ratios = lockstep(fns, steps, 1, device)
    last = {mode: float(losses[mode][-1]) for mode in fns}
    speedup = {r: ratios[r] for r in recipes if r in ratios}
    return StepRow("transformer", size, ms, speedup, converted, skipped, last, errors)


def sqnr_table(recipes: list[str], device: torch.device) -> dict[str, dict[str, float]]:
    """SQNR (dB) of one fp8 linear 256 -> 512 on 256 bf16 tokens against the same layer in bf16, per recipe
    (the layer and batch of tests/fp8/test_fp8_linear.py::test_sqnr_against_bf16_reference), on ``device``
    (a GPU's fp8 GEMMs, or the CPU's emulation)."""
    from mixprec._src.observe.fp8_diagnostics import sqnr

    table = {}
    for recipe in recipes:
        torch.manual_seed(0)
        layer = nn.Linear(256, 512).bfloat16().to(device)
        reference = copy.deepcopy(layer)
        fp8_conversion.convert(layer, mixprec.Fp8Config(mixprec.Fp8Recipe(recipe), convert_head=True), set())
        x = torch.randn(4, 64, 256, dtype=torch.bfloat16).to(device)
        runs = []
        for module in (layer, reference):
            given = x.clone().requires_grad_()
            out = module(given)
            out.float().square().sum().backward()
            runs.append((out.detach(), module.weight.grad, given.grad))
        (out, gw, gx), (ref_out, ref_gw, ref_gx) = runs
        table[recipe] = {"output": sqnr(out, ref_out), "weight gradient": sqnr(gw, ref_gw),
                         "input gradient": sqnr(gx, ref_gx)}  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, the tiny transformer, few steps")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated fp8 recipes")
    parser.add_argument("--shapes", help="comma-separated MxKxN (default: per device, smaller with --quick)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the layer and the model")
    parser.add_argument("--steps", type=int, help="timed training steps per mode (default 20, --quick 3)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--sqnr-only", action="store_true", help="only the SQNR of each recipe against bf16")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="per shape and mode, one call taken apart: the host's time to issue it, the device's kernels",
    )
    parser.add_argument(
        "--aten-casts",
        action="store_true",
        help="also each tensorwise recipe with the ATen ops' casts (on CUDA: against the fused cast)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    recipes = [r for r in args.recipes.split(",") if r]
    if unknown := sorted(set(recipes) - set(RECIPES)):
        parser.error(f"unknown recipe(s) {', '.join(unknown)}; valid: {', '.join(RECIPES)}")
    shapes = SHAPES[(device.type, args.quick)]
    if args.shapes:
        shapes = tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))  # type: ignore[misc]
    steps = args.steps or (3 if args.quick else 20)
    windows, calls = (3, 1) if args.quick else (7, 10 if device.type == "cuda" else 2)
    size = "tiny" if args.quick else "default" if device.type == "cuda" else "quick"

    print("SQNR against bf16, one linear 256 -> 512 on 256 tokens (dB): output, weight gradient, input gradient")
    for recipe, row in sqnr_table(recipes, device).items():
        print(f"  {recipe:<20} " + "  ".join(f"{v:5.1f}" for v in row.values()))
    if args.sqnr_only:
        return
    modes = [*recipes, *(r + ATEN for r in recipes if r in FUSED)] if args.aten_casts else recipes
    print(f"device: {device_name(device)}; torch {torch.__version__}, bf16{', compiled' if args.compile else ''}")
    if device.type == "cpu":
        print(CPU_NOTE)
    width = max(len(r) for r in modes) if modes else 0
    cell = max(width, 16)
    print(f"\nlinear forward+backward, median ms (speed-up over bf16), {windows} windows of {calls} call(s)")
    print(f"  {'M x K x N':<20} {'bf16':>9} " + " ".join(f"{r:>{cell}}" for r in modes))
    gemm_rows = []
    for shape in shapes:
        row = bench_gemm(shape, modes, device, args.compile, windows, calls, args.profile)
        gemm_rows.append(row)
        cells = [f"{row.ms[r]:.3f} ({row.speedup[r]:.2f}x)" if r in row.ms else "error" for r in modes]
        print(f"  {'x'.join(map(str, shape)):<20} {row.ms['bf16']:>9.3f} " + " ".join(f"{c:>{cell}}" for c in cells))
        for recipe, error in row.errors.items():
            print(f"    {recipe}: {error}")

    step_row = bench_steps(modes, device, size, steps, args.compile)
    print(f"\ntraining step, transformer ({size}), O1 bf16 vs O1 + fp8, median of {steps} steps per mode")
    print(f"  {'mode':<{cell}} {'ms/step':>9} {'vs bf16':>8} {'fp8 linears':>12} {'last loss':>10}")
    for mode, ms in step_row.ms.items():
        ratio = f"{step_row.speedup[mode]:.2f}x" if mode in step_row.speedup else ""
        linears = f"{step_row.converted[mode]} (+{step_row.skipped[mode]} out)" if mode in step_row.converted else ""
        print(f"  {mode:<{cell}} {ms:>9.2f} {ratio:>8} {linears:>12} {step_row.last_loss[mode]:>10.4f}")
    for recipe, error in step_row.errors.items():
        print(f"  {recipe}: {error}")
    if args.json:
        with open(args.json, "w") as f:
            gemm = [dataclasses.asdict(r) for r in gemm_rows]
            result = {"device": device_name(device), "torch": torch.__version__, "compile": args.compile}
            json.dump({**result, "gemm": gemm, "steps": dataclasses.asdict(step_row)}, f, indent=2)


if __name__ == "__main__":
    main()
