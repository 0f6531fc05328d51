"""Run every workload in every mode and measure speed, memory and loss.

Measures, per workload and mode:

* ``steps_per_s``: after ``warmup`` steps, the median over timed windows of ``window``
  steps each (CUDA is synchronised around every step). The modes of a workload train in
  lockstep, each step running every mode in alternating order, so that the load of a
  shared machine falls on all of them alike;
* ``peak_mem_bytes``: measured in a separate run of two steps per mode, alone, from
  building the model on: on CUDA, ``torch.cuda.max_memory_allocated`` above the level
  before that run; on Linux CPUs, the peak resident set size above the level before
  the run, sampled every 2 ms from ``/proc/self/statm`` (it includes allocator caching,
  so read it as indicative); elsewhere ``None``;
* ``final_loss``: the mean loss of the last steps (a fifth of them, 1 to 5), and its
  relative difference from fp32's after the same steps;
* ``tuning_s``: for a mode settled per workload (``mixprec-tuned``), the seconds that took,
  on a fresh copy of the workload before anything else runs; not counted in ``steps_per_s``.

With ``compile``, the modes in ``compile_modes`` also train as ``torch.compile(model)`` of the
model the mode prepared (the default inductor backend), as ``"<mode>+compile"``, in lockstep with
the eager runs. Compiling happens in the warm-up steps: ``compile_s`` is their time beyond as many
timed steps. Dynamo's counters (``torch._dynamo.utils.counters``) are read around each of the
run's steps: ``graphs`` and ``graph_breaks`` are what it compiled during warm-up, ``recompiles``
the frames it had to compile again after warm-up (0 when the graphs hold), ``eager_frames`` the
frames it gave up on (they ran eagerly), ``inductor_cache_hits`` the graphs inductor loaded from
its on-disk cache of earlier runs (which makes ``compile_s`` small). Every compiled run is
compared with the same mode's eager run (``vs_eager``) and with compiled torch.amp
(``vs_compiled_torch_amp``). Each workload starts
from an empty compile cache (``torch._dynamo.reset()``). Every compiled module is a cache entry of
one wrapper frame of torch's, so two modes' models can share a graph when dynamo's guards let them:
the workload's recompile limit is raised by the number of compiled runs (one mode's graphs do not
push another's out), and module hooks are guarded (``skip_nnmodule_hook_guards=False``; torch skips
those guards by default), so that no run takes a graph traced for a model whose hooks differ
(``prepare`` keeps norm layers in fp32 with hooks).

Every mode of a workload starts from the same seeded model and sees the same batches.

Long because it is one run's whole procedure, eager and compiled: the lockstep timing, the separate memory
runs and the loss, in the order a run takes them; the tables and plots are ``bench.report``'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import mixprec
from mixprec._src.observe.memory_report import state_bytes
from mixprec._src.tune.tables import layer_table
from mixprec.bench.devices import resolve_device, resolve_dtype, sync
from mixprec.bench.modes import MODES, Mode
from mixprec.bench.peak_memory import PeakMemory
from mixprec.bench.workloads import SIZES, WORKLOADS, Task

# Default steps per size; each mode of a workload runs the same number.
DEFAULT_STEPS = {"tiny": 3, "quick": 10, "default": 24}

Progress = Callable[[str, str, int, int], None]  # (workload, mode, steps done, steps total)

DEFAULT_MODES = ("fp32", "torch-amp", "mixprec", "mixprec-cl", "mixprec-tuned")
#: What ``mixprec bench --compile`` compiles by default: torch.autocast, mixprec.autocast and each prepare level
#: (O1 also without norm layers kept in fp32, which is torch.amp's precision).
COMPILE_MODES = ("torch-amp", "mixprec", "O1", "O1-nokeep", "O2", "bf16-sr", "bf16-pure")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to run. ``device``/``dtype`` ``"auto"`` pick the fastest supported setting."""

    workloads: tuple[str, ...] = tuple(WORKLOADS)
    modes: tuple[str, ...] = DEFAULT_MODES
    steps: int | None = None
    warmup: int = 2
    window: int = 1
    device: str = "auto"
    dtype: str = "auto"
    size: str = "default"
    compile: bool = False  # also run modes with torch.compile(model), as "<mode>+compile"
    compile_modes: tuple[str, ...] | None = None  # the modes compiled (None: every mode); each also runs eagerly
    count_fp8_kernels: bool = False  # with compile: count inductor's kernels per fp8 linear, mixprec vs torchao
    tune_budget_s: float = 60.0  # mixprec.tune's budget per workload (mixprec-tuned)

    def __post_init__(self) -> None:
        for name in self.workloads:
            if name not in WORKLOADS:
                raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
        for name in self.modes:
            if name not in MODES:
                raise ValueError(f"unknown mode {name!r}; valid: {', '.join(MODES)}")
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; valid: {', '.join(SIZES)}")
        if self.steps is not None and self.steps < self.warmup + 1:
            raise ValueError(f"steps must exceed warmup ({self.warmup}) so that some steps are timed")
        if self.window < 1 or self.warmup < 0:
            raise ValueError("window must be >= 1 and warmup >= 0")
        for name in self.compile_modes or ():
            if name not in self.modes:
                raise ValueError(
                    f"compile mode {name!r} is not among the modes ({', '.join(self.modes)}): a compiled "
                    "run is compared with the same mode's eager run, so add it to the modes"
                )
        if not self.tune_budget_s > 0:
            raise ValueError(f"tune_budget_s must be a positive number of seconds, got {self.tune_budget_s}")

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else max(DEFAULT_STEPS[self.size], self.warmup + 1)


@dataclasses.dataclass
class ModeResult:
    """What one mode measured on one workload."""

    steps_per_s: float
    final_loss: float
    peak_mem_bytes: int | None
    losses: list[float]
    seconds: float
    state_bytes: int = 0  # parameters + gradients + fp32 masters + optimizer state, exactly
    speedup_vs_fp32: float | None = None
    vs_torch_amp: float | None = None
    loss_rel_diff_vs_fp32: float | None = None
    tuning_s: float | None = None  # settling the mode on this workload (mixprec.tune), apart from training
    recipe: str | None = None  # what it settled on
    layer_plan: str | None = None  # the settled recipe's per-layer plan, as a text table
    compiled: bool = False  # trained as torch.compile(model) (a "<mode>+compile" run)
    compile_s: float | None = None  # compiled: the warm-up steps' time beyond as many timed steps
    graphs: int | None = None  # compiled: graphs dynamo compiled during warm-up
    graph_breaks: int | None = None  # compiled: graph breaks dynamo met during warm-up
    recompiles: int | None = None  # compiled: frames dynamo compiled again after warm-up (should be 0)
    eager_frames: int | None = None  # compiled: frames dynamo gave up on (they ran eagerly), e.g. at its limit
    inductor_cache_hits: int | None = None  # compiled: graphs inductor loaded from its on-disk cache (fast compile)
    vs_eager: float | None = None  # compiled: steps/s over the same mode's eager run
    vs_compiled_torch_amp: float | None = None  # compiled: steps/s over compiled torch-amp's
    loss_rel_diff_vs_eager: float | None = None  # compiled: final loss against the eager run's

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class BenchReport:
    """All results, plus what they were measured on."""

    device: str
    device_name: str
    dtype: str
    torch_version: str
    mixprec_version: str
    config: BenchConfig
    results: dict[str, dict[str, ModeResult]]
    images: dict[str, dict[str, torch.Tensor]]  # workload -> {"target": ..., mode: prediction}
    seconds: float
    interrupted: bool = False  # stopped early (Ctrl-C): ``results`` holds the workloads that finished
    fp8_kernels: dict[str, Any] | None = None  # kernels.count_fp8_kernels (with compile and count_fp8_kernels)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # workload -> the error that stopped it

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: ``{"device", "dtype", "torch", "workloads": {name: {mode: {...}}}, ...}``."""
        return {
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "torch": self.torch_version,
            "mixprec": self.mixprec_version,
            "config": dataclasses.asdict(self.config),
            "seconds": self.seconds,
            "interrupted": self.interrupted,
            "failed": self.failed,
            "workloads": {w: {m: r.to_dict() for m, r in modes.items()} for w, modes in self.results.items()},
            "fp8_kernels": self.fp8_kernels,
        }


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run` after at least one workload finished; ``report`` holds those workloads."""

    def __init__(self, report: BenchReport) -> None:
        super().__init__("interrupted")
        self.report = report


def make_optimizer(task: Task, params: Any) -> torch.optim.Optimizer:
    """The task's optimizer over ``params``."""
    # Fused kernels: the same choice in every mode, and the fixed fp32 cost of a step stays small.
    if task.optimizer == "adam":
        return torch.optim.Adam(params, lr=task.lr, fused=True)
    return torch.optim.AdamW(params, lr=task.lr, fused=True)


class _Run:
    """One mode's model, optimizer and scaler on one workload, stepped by the runner."""

    def __init__(
        self,
        workload: str,
        mode: Mode,
        config: BenchConfig,
        device: torch.device,
        dtype: torch.dtype,
        compiled: bool = False,
    ):
        self.workload, self.mode, self.config, self.device, self.dtype = workload, mode, config, device, dtype
        self.task = WORKLOADS[workload].build(config.size, device)
        self.model = mode.prepare_model(self.task.model.to(device))
        self.optimizer = make_optimizer(self.task, self.model.parameters())
        if mode.setup is not None:
            self.model, self.optimizer = mode.setup(self.model, self.optimizer, dtype)
        self.state_model = self.model
        self.compiled = compiled
        self.counts: list[dict[str, int]] = []  # compiled: dynamo's counters' change over each step
        if compiled:  # compiled on the first (warm-up, untimed) step
            self.model = torch.compile(self.model)  # type: ignore[assignment]
        use_scaler = mode.scaler is not None and dtype is torch.float16
        self.scaler = mode.scaler(device.type) if use_scaler else None  # type: ignore[misc]
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []
        self.output: torch.Tensor | None = None

    def step(self, step: int) -> float:
        """One training step; returns its wall time (CUDA synchronised)."""
        inputs, targets = self.task.batch(step)
        inputs = self.mode.prepare_input(inputs)
        before = dynamo_counts() if self.compiled else None
        if self.device.type == "cuda":
            sync(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with self.mode.context(self.device.type, self.dtype):
            output = self.model(inputs)
            loss = self.task.loss_fn(output, targets)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
        if self.device.type == "cuda":
            sync(self.device)
        elapsed = time.perf_counter() - start
        if before is not None:
            after = dynamo_counts()
            self.counts.append({key: after[key] - before[key] for key in after})
        self.losses.append(loss.detach())
        self.output = output
        return elapsed


def dynamo_counts() -> dict[str, int]:
    """Dynamo's running totals: frames it tried to compile (``frames``), compiled (``ok``), graphs, graph breaks,
    and the graphs inductor took from its on-disk cache (``cache_hits``)."""
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"]["total"],
        "ok": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
    }


def measure_memory(
    workload: str, mode: Mode, config: BenchConfig, device: torch.device, dtype: torch.dtype, steps: int = 2
) -> int | None:
    """Peak memory of building the workload and training it ``steps`` steps, alone.

    A mode that sets the model up (the ``prepare`` levels) first trains one step of the tiny
    size outside the measurement: kernels it compiles once per process (the fused bf16-sr
    step) are not training memory, and would otherwise count against whichever mode ran first.
    """
    if mode.setup is not None:
        warm = _Run(workload, mode, dataclasses.replace(config, size="tiny"), device, dtype)
        warm.step(0)
        del warm
    memory = PeakMemory(device)
    with memory:
        run = _Run(workload, mode, config, device, dtype)
        for step in range(steps):
            run.step(step)
        del run
    return memory.peak_bytes


def run_workload(
    workload: str,
    modes: list[Mode],
    config: BenchConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None = None,
    on_result: Callable[[str, str, ModeResult], None] | None = None,
) -> tuple[dict[str, ModeResult], dict[str, torch.Tensor]]:
    """Train ``workload`` in every mode in lockstep: each step runs every mode, in alternating order,
    so that the machine's load drifts over all modes alike."""
    steps = config.total_steps
    modes = list(modes)
    settled: dict[str, float] = {}
    for i, mode in enumerate(modes):
        if mode.resolve is not None:
            task = WORKLOADS[workload].build(config.size, device)
            task.model.to(device)
            begin = time.perf_counter()
            modes[i] = dataclasses.replace(
                mode.resolve(task, make_optimizer(task, task.model.parameters()), dtype, config.tune_budget_s),
                resolve=None,
            )
            settled[mode.name] = time.perf_counter() - begin
            del task
    peaks = {mode.name: measure_memory(workload, mode, config, device, dtype) for mode in modes}
    runs = {mode.name: _Run(workload, mode, config, device, dtype) for mode in modes}
    compiled = [mode for mode in modes if config.compile and mode.name in (config.compile_modes or config.modes)]
    if compiled:
        torch._dynamo.reset()  # this workload's graphs only
    for mode in compiled:
        runs[f"{mode.name}+compile"] = _Run(workload, mode, config, device, dtype, compiled=True)
        peaks[f"{mode.name}+compile"] = None  # the compiled run's memory is not measured apart
    order = list(runs)
    # Every compiled module is a cache entry of the same wrapper frame: room for each run's graphs, and guards on
    # module hooks, so that no run takes a graph traced for another mode's model whose hooks differ.
    limit = torch._dynamo.config.recompile_limit + len(compiled)
    with torch._dynamo.config.patch(recompile_limit=limit, skip_nnmodule_hook_guards=False):
        for step in range(steps):
            for name in order if step % 2 == 0 else reversed(order):
                runs[name].times.append(runs[name].step(step))
                if progress is not None:
                    progress(workload, name, step + 1, steps)
    results: dict[str, ModeResult] = {}
    images: dict[str, torch.Tensor] = {}
    tail = max(1, min(5, steps // 5))
    for name, run in runs.items():
        values = [float(v) for v in torch.stack(run.losses).float().tolist()]
        if not all(math.isfinite(v) for v in values[-3:]):
            raise RuntimeError(f"{workload}/{name}: the loss is not finite at the end of the run ({values[-3:]})")
        timed = run.times[config.warmup :]
        windows = [statistics.fmean(timed[i : i + config.window]) for i in range(0, len(timed), config.window)]
        results[name] = result = ModeResult(
            steps_per_s=1.0 / statistics.median(windows),
            final_loss=statistics.fmean(values[-tail:]),
            peak_mem_bytes=peaks[name],
            losses=values,
            seconds=sum(run.times),
            state_bytes=state_bytes(run.state_model, run.optimizer),
            tuning_s=settled.get(name.removesuffix("+compile")),
            recipe=run.mode.description if name.removesuffix("+compile") in settled else None,
            layer_plan=layer_table(run.mode.recipe.layers, width=104)
            if run.mode.recipe and run.mode.recipe.layers
            else None,
        )
        if run.compiled:
            _compile_stats(result, run, config.warmup, statistics.median(timed))
        if run.task.image and run.output is not None:
            images[name] = run.output.detach().float().cpu()[0, 0]
            images["target"] = run.task.batch(0)[1].float().cpu()[0, 0]
    _compare(results)
    if on_result is not None:
        for name, result in results.items():
            on_result(workload, name, result)
    return results, images


def run(
    config: BenchConfig,
    progress: Progress | None = None,
    on_result: Callable[[str, str, ModeResult], None] | None = None,
    on_workload: Callable[[BenchReport], None] | None = None,
) -> BenchReport:
    """Run ``config``; ``progress`` hears every step of every mode, ``on_result`` every finished mode,
    ``on_workload`` the report so far after each workload (to write it: finished work is never lost).

    A workload that raises is recorded in the report's ``failed`` (its error) and the next one runs.

    Raises:
        BenchInterrupted: Ctrl-C (a ``KeyboardInterrupt``) after at least one workload finished; its
            ``report`` holds the finished workloads, marked ``interrupted``. Before that, the
            ``KeyboardInterrupt`` itself.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    start = time.perf_counter()
    # One tiny untimed pass of every mode first: one-time costs (thread pools, kernel caches,
    # first allocations) would otherwise land in the speed and memory of whichever mode runs first.
    warm = dataclasses.replace(
        config,
        size="tiny",
        steps=None,
        warmup=1,
        window=1,
        compile=False,
        tune_budget_s=min(config.tune_budget_s, 10.0),
    )
    for workload in config.workloads:
        run_workload(workload, _modes_for(workload, config, dtype), warm, device, dtype)
    results: dict[str, dict[str, ModeResult]] = {}
    images: dict[str, dict[str, torch.Tensor]] = {}
    kernels: dict[str, Any] | None = None
    failed: dict[str, str] = {}

    def report(interrupted: bool) -> BenchReport:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
        return BenchReport(
            device.type,
            name,
            {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
            torch.__version__,
            mixprec.__version__,
            config,
            results,
            images,
            time.perf_counter() - start,
            interrupted,
            kernels,
            dict(failed),
        )

    try:
        if config.compile and config.count_fp8_kernels:  # first: it also pays inductor's one-time start-up
            from mixprec.bench.kernels import count_fp8_kernels

            kernels = count_fp8_kernels(device)
        for workload in config.workloads:
            try:
                results[workload], found = run_workload(
                    workload, _modes_for(workload, config, dtype), config, device, dtype, progress, on_result
                )
            except Exception as exc:  # the finished workloads stand; this one is reported with its error
                failed[workload] = f"{type(exc).__name__}: {exc}"
                found = None
            if found:
                images[workload] = found
            if on_workload is not None:
                on_workload(report(False))
    except KeyboardInterrupt as exc:
        if not results:
            raise
        raise BenchInterrupted(report(True)) from exc
    return report(False)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo, else the platform's)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or "cpu"


def _modes_for(workload: str, config: BenchConfig, dtype: torch.dtype) -> list[Mode]:
    return [MODES[m] for m in config.modes if MODES[m].trains(WORKLOADS[workload].conv) and dtype in MODES[m].dtypes]


def _compile_stats(result: ModeResult, run: _Run, warmup: int, median_step: float) -> None:
    """Fill a compiled run's compile time and dynamo counts (see the module docstring)."""
    total = {key: sum(c[key] for c in run.counts) for key in ("frames", "ok")}
    result.compiled = True
    result.compile_s = max(0.0, sum(run.times[:warmup]) - warmup * median_step)
    result.graphs = sum(c["graphs"] for c in run.counts[:warmup])
    result.graph_breaks = sum(c["breaks"] for c in run.counts[:warmup])
    result.inductor_cache_hits = sum(c["cache_hits"] for c in run.counts)
    result.recompiles = sum(c["frames"] for c in run.counts[warmup:])
    result.eager_frames = total["frames"] - total["ok"]


def _compare(by_mode: dict[str, ModeResult]) -> None:
    fp32 = by_mode.get("fp32")
    amp = by_mode.get("torch-amp")
    compiled_amp = by_mode.get("torch-amp+compile")
    for name, result in by_mode.items():
        if fp32 is not None:
            result.speedup_vs_fp32 = result.steps_per_s / fp32.steps_per_s
            result.loss_rel_diff_vs_fp32 = (result.final_loss - fp32.final_loss) / abs(fp32.final_loss)
        if amp is not None:
            result.vs_torch_amp = result.steps_per_s / amp.steps_per_s
        eager = by_mode.get(name.removesuffix("+compile")) if result.compiled else None
        if eager is not None:
            result.vs_eager = result.steps_per_s / eager.steps_per_s
            result.loss_rel_diff_vs_eager = (result.final_loss - eager.final_loss) / abs(eager.final_loss)
        if result.compiled and compiled_amp is not None:
            result.vs_compiled_torch_amp = result.steps_per_s / compiled_amp.steps_per_s
