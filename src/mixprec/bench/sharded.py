"""``mixprec bench --nproc N``: each prepare level under FSDP2 over N processes, beside torch's own FSDP2.

Every rank builds the same seeded workload, wraps its blocks and then the model with
``fully_shard``, builds the optimizer and calls :func:`mixprec.prepare` (or, for torch's own
modes, sets FSDP2 up the way torch documents it). The modes of a workload train in lockstep,
each step running every mode in alternating order, so that the load of a shared machine falls
on all of them alike; a step is timed from a barrier before it to a barrier after it (the
slowest rank's time). Measured per mode: steps/s (median of the timed steps), each rank's
training state (:func:`mixprec.memory_report`: weights, masters, gradients, optimizer state;
the largest rank is reported) and the final loss (mean of the last steps over every rank's
batch). The same modes then run in one process on the whole batch, unsharded, for the
comparison. Torch's own modes, the speed references:

* ``torch-amp``: fp32 shards, the forward under ``torch.autocast`` (O1's equivalent);
* ``torch-mp``: ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)`` with
  ``torch.autocast`` (O2's; sharded only);
* ``torch-bf16``: the model in bf16, gradients reduced in fp32 (bf16-pure's and bf16-sr's).

``mixprec bench --nproc N`` spawns N processes on this machine (gloo on CPU, NCCL on CUDA, one
GPU each). Under ``torchrun`` run ``python -m mixprec.bench.sharded`` (its ``--help`` lists the
options): it reads the rank and world size torchrun sets, and rank 0 prints and writes the report.

Long because it is one sharded run's whole procedure: the launch, every rank's lockstep steps, the one-process
comparison and the relay of progress from the ranks, in the order a run takes them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mixprec
from mixprec.bench.devices import rank_device, resolve_dtype, sync
from mixprec.bench.tables import aligned, markdown_table
from mixprec.bench.workloads import SIZES, WORKLOADS, Task

#: the bench's modes under FSDP2, in the order they are reported
SHARDED_MODES = ("torch-amp", "O1", "torch-mp", "O2", "torch-bf16", "bf16-pure", "bf16-sr")
#: each prepare level's nearest torch equivalent, for the speed ratio
TORCH_EQUIVALENT = {"O1": "torch-amp", "O2": "torch-mp", "bf16-pure": "torch-bf16", "bf16-sr": "torch-bf16"}
LEVELS = ("O1", "O2", "bf16-sr", "bf16-pure")
DEFAULT_STEPS = {"tiny": 4, "quick": 8, "default": 12}

Progress = Callable[[str, str, int, int], None]


@dataclasses.dataclass(frozen=True)
class ShardedConfig:
    """What ``mixprec bench --nproc`` runs."""

    nproc: int = 2
    workloads: tuple[str, ...] = ("transformer",)
    modes: tuple[str, ...] = SHARDED_MODES
    size: str = "default"
    steps: int | None = None
    warmup: int = 2
    device: str = "auto"
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {self.nproc}")
        for name in self.workloads:
            if name not in WORKLOADS:
                raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
        for name in self.modes:
            if name not in SHARDED_MODES:
                raise ValueError(f"unknown mode {name!r} under --nproc; valid: {', '.join(SHARDED_MODES)}")
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; valid: {', '.join(SIZES)}")
        if self.steps is not None and self.steps < self.warmup + 1:
            raise ValueError(f"steps must exceed warmup ({self.warmup}) so that some steps are timed")

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else DEFAULT_STEPS[self.size]


@dataclasses.dataclass
class ShardedResult:
    """One mode on one workload at one world size."""

    world_size: int
    steps_per_s: float
    final_loss: float
    state_bytes: int  # the largest rank's training state (memory_report total)
    memory: dict[str, int]  # that rank's memory_report
    losses: list[float]
    vs_torch: float | None = None  # steps/s over the torch equivalent's, same world size
    state_vs_one_process: float | None = None  # state_bytes over the same mode's in one process
    loss_vs_one_process: float | None = None  # relative difference of the final loss

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----- one rank ------------------------------------------------------------------------------


def _blocks(workload: str, model: nn.Module) -> list[nn.Module]:
    """The modules each sharded as a unit before the model itself (a transformer's layers, say)."""
    if workload == "transformer":
        return list(model.blocks.layers)  # type: ignore[union-attr,arg-type]
    if workload == "cnn":
        return list(model.stages)  # type: ignore[union-attr,arg-type]
    if workload == "mlp":
        return [m for m in model.modules() if isinstance(m, nn.Linear)]
    return []


def _setup(
    mode: str, task: Task, workload: str, world: int, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Any]]:
    """The sharded (or, in one process, plain) model, its optimizer and the forward's context."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = task.model.to(device)
    if mode == "torch-bf16":
        model = model.to(dtype)
    policy = {
        "torch-mp": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        "torch-bf16": MixedPrecisionPolicy(reduce_dtype=torch.float32),
    }.get(mode)
    if world > 1:
        policy = policy if policy is not None else MixedPrecisionPolicy()
        for block in _blocks(workload, model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    # foreach, not fused: the fused CPU kernels take no DTensors
    opt: torch.optim.Optimizer = (torch.optim.Adam if task.optimizer == "adam" else torch.optim.AdamW)(
        model.parameters(), lr=task.lr
    )
    if mode in LEVELS:  # a prepared model opens its own region
        model, opt = mixprec.prepare(model, opt, level=mode, dtype=dtype)
        return model, opt, contextlib.nullcontext
    return model, opt, functools.partial(torch.autocast, device.type, dtype=dtype)


@dataclasses.dataclass
class _ModeRun:
    task: Task
    model: nn.Module
    opt: torch.optim.Optimizer
    context: Callable[[], Any]
    scaler: mixprec.GradScaler | None
    times: list[float] = dataclasses.field(default_factory=list)
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def step(self, step: int, rank: int, world: int, device: torch.device) -> None:
        inputs, targets = self.task.batch(step)
        inputs, targets = inputs.chunk(world)[rank], targets.chunk(world)[rank]
        sync(device, world)
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.context():
            loss = self.task.loss_fn(self.model(inputs), targets)
        if self.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            self.scaler.step(self.opt)
            self.scaler.update()
        sync(device, world)
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.detach().float())


def _rank_run(
    config: ShardedConfig, rank: int, world: int, device: torch.device, dtype: torch.dtype, progress: Progress | None
) -> dict[str, dict[str, Any]]:
    """This rank's measurements for every workload and mode."""
    out: dict[str, dict[str, Any]] = {}
    steps = config.total_steps
    modes = [m for m in config.modes if world > 1 or m != "torch-mp"]  # torch-mp has no one-process form
    if dtype is torch.float16:  # bf16 weights need bf16
        modes = [m for m in modes if m not in ("torch-bf16", "bf16-pure", "bf16-sr")]
    for workload in config.workloads:
        runs = {}
        for mode in modes:
            task = WORKLOADS[workload].build(config.size, device)
            model, opt, context = _setup(mode, task, workload, world, dtype, device)
            scaler = mixprec.GradScaler(device.type) if dtype is torch.float16 else None
            runs[mode] = _ModeRun(task, model, opt, context, scaler)
        for step in range(steps):
            for mode in modes if step % 2 == 0 else reversed(modes):
                runs[mode].step(step, rank, world, device)
                if progress is not None:
                    progress(workload, mode, step + 1, steps)
        out[workload] = {}
        for mode, run in runs.items():
            losses = torch.stack(run.losses)
            if world > 1:
                dist.all_reduce(losses)
            out[workload][mode] = {
                "times": run.times,
                "losses": (losses / world).tolist(),
                "memory": mixprec.memory_report(run.model, run.opt).to_dict(),
            }
        del runs
    return out


def _quiet() -> None:
    """No library notes in the bench's output (FSDP2 warns that the workloads' heads return views)."""
    import warnings

    warnings.filterwarnings("ignore", module="torch.distributed")


def _worker(rank: int, world: int, port: int, results: Any, config: ShardedConfig, queue: Any) -> None:
    _quiet()
    device = rank_device(config.device, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    progress = None
    if rank == 0 and queue is not None:

        def progress(workload: str, mode: str, done: int, total: int) -> None:
            queue.put((world, workload, mode, done, total))

    try:
        results[rank] = _rank_run(config, rank, world, device, resolve_dtype(config.dtype, device), progress)
    finally:
        if world > 1:
            dist.destroy_process_group()


# ----- the whole run ----------------------------------------------------------------------------


def _summarise(
    ranks: list[dict[str, dict[str, Any]]], world: int, config: ShardedConfig
) -> dict[str, dict[str, ShardedResult]]:
    out: dict[str, dict[str, ShardedResult]] = {}
    tail = max(1, min(3, config.total_steps // 4))
    for workload, modes in ranks[0].items():
        out[workload] = {}
        for mode, measured in modes.items():
            largest = max((r[workload][mode]["memory"] for r in ranks), key=lambda m: m["total"])
            timed = measured["times"][config.warmup :]
            out[workload][mode] = ShardedResult(
                world_size=world,
                steps_per_s=1.0 / statistics.median(timed),
                final_loss=statistics.fmean(measured["losses"][-tail:]),
                state_bytes=largest["total"],
                memory=largest,
                losses=measured["losses"],
            )
        for mode, result in out[workload].items():
            reference = out[workload].get(TORCH_EQUIVALENT.get(mode, ""))
            if reference is not None:
                result.vs_torch = result.steps_per_s / reference.steps_per_s
    return out


def run(config: ShardedConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Spawn ``config.nproc`` processes (and then one) on this machine and measure; returns the report.

    ``progress(f"{world} ranks", f"{workload}/{mode}", step, steps)`` hears rank 0's steps.
    """
    import threading

    import torch.multiprocessing as mp

    device = rank_device(config.device, 0)
    if device.type == "cuda" and config.nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc {config.nproc} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    start = time.perf_counter()
    context = mp.get_context("spawn")
    manager = context.Manager()
    by_world: dict[int, dict[str, dict[str, ShardedResult]]] = {}
    for world in dict.fromkeys((config.nproc, 1)):
        results, queue = manager.dict(), manager.Queue()
        done = threading.Event()

        def relay(queue: Any = queue, world: int = world, done: threading.Event = done) -> None:
            while not done.is_set() or not queue.empty():
                try:
                    _, workload, mode, step, steps = queue.get(timeout=0.1)
                except Exception:  # an empty queue's timeout
                    continue
                if progress is not None:
                    progress(f"{world} rank{'s' if world > 1 else ''}", f"{workload}/{mode}", step, steps)

        relayer = threading.Thread(target=relay, daemon=True)
        relayer.start()
        try:
            mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
                _worker,
                args=(world, _free_port(), results, config, queue),
                nprocs=world,
                start_method="spawn",
                join=True,
            )
        finally:
            done.set()
            relayer.join()
        by_world[world] = _summarise([dict(results[r]) for r in range(world)], world, config)
    _compare_with_one_process(by_world, config.nproc)
    return _report(
        config, device, {str(w): _as_dicts(found) for w, found in by_world.items()}, time.perf_counter() - start
    )


def _compare_with_one_process(by_world: dict[int, dict[str, dict[str, ShardedResult]]], nproc: int) -> None:
    single = by_world.get(1, {})
    for workload, modes in by_world.get(nproc, {}).items():
        for mode, result in modes.items():
            one = single.get(workload, {}).get(mode)
            if one is not None:
                result.state_vs_one_process = result.state_bytes / one.state_bytes
                result.loss_vs_one_process = (result.final_loss - one.final_loss) / abs(one.final_loss)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----- report ---------------------------------------------------------------------------------

HEADER = ("workload", "mode", "ranks", "steps/s", "vs torch", "state/rank", "vs 1 proc", "final loss", "loss vs 1 proc")


def rows(report: dict[str, Any]) -> Iterable[tuple[str, ...]]:
    """The report as table rows, the sharded run first and then one process, mode by mode."""
    mib = 1 << 20
    worlds = sorted(report["results"], key=int, reverse=True)
    for world in worlds:
        for workload, modes in report["results"][world].items():
            for mode in SHARDED_MODES:
                r = modes.get(mode)
                if r is None:
                    continue
                yield (
                    workload,
                    mode,
                    str(world),
                    f"{r['steps_per_s']:.3g}",
                    "" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}x",
                    f"{r['state_bytes'] / mib:.1f} MiB",
                    "" if r["state_vs_one_process"] is None else f"{r['state_vs_one_process']:.3f}",
                    f"{r['final_loss']:.4f}",
                    "" if r["loss_vs_one_process"] is None else f"{100 * r['loss_vs_one_process']:+.2f}%",
                )


def text_table(report: dict[str, Any]) -> str:
    """The report as a plain aligned table (logs, narrow terminals)."""
    return "\n".join(aligned(HEADER, list(rows(report)), left=("workload", "mode")))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"mixprec bench --nproc {report['config']['nproc']}: {report['device_name']}, {report['dtype']}, "
        f"size {report['config']['size']}, torch {report['torch']}",
        "",
        *markdown_table(HEADER, list(rows(report))),
    ]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: str) -> list[Path]:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "sharded.json", folder / "sharded.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    return paths


# ----- torchrun --------------------------------------------------------------------------------


def _torchrun(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mixprec.bench.sharded",
        description="Under torchrun: each prepare level under FSDP2 on this job's ranks beside torch's own "
        "FSDP2 (rank 0 prints and writes the report).",
    )
    parser.add_argument("--workloads", default="transformer")
    parser.add_argument("--modes", default=",".join(SHARDED_MODES))
    parser.add_argument("--size", choices=SIZES, default="default")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--out", default="mixprec-bench")
    args = parser.parse_args(argv)
    _quiet()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    config = ShardedConfig(
        nproc=world,
        workloads=tuple(args.workloads.split(",")),
        modes=tuple(args.modes.split(",")),
        size=args.size,
        steps=args.steps,
        device=device.type,
        dtype=args.dtype,
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    measured = _rank_run(config, rank, world, device, resolve_dtype(args.dtype, device), None)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, measured)
    dist.destroy_process_group()
    if rank == 0:
        results = {str(world): _as_dicts(_summarise(gathered, world, config))}
        report = _report(config, device, results, time.perf_counter() - start)
        print(text_table(report), flush=True)
        print("wrote " + ", ".join(str(p) for p in write(report, args.out)))
    return 0


def _as_dicts(results: dict[str, dict[str, ShardedResult]]) -> dict[str, dict[str, dict[str, Any]]]:
    return {workload: {mode: r.to_dict() for mode, r in modes.items()} for workload, modes in results.items()}


def _report(config: ShardedConfig, device: torch.device, results: dict[str, Any], seconds: float) -> dict[str, Any]:
    from mixprec.bench.runner import cpu_name

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "device": device.type,
        "device_name": name,
        "dtype": config.dtype,
        "torch": torch.__version__,
        "mixprec": mixprec.__version__,
        "config": dataclasses.asdict(config),
        "seconds": seconds,
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
