"""What a training step costs at each level and optimizer-state precision: ``mixprec bench --step-cost``.

For each recipe (torch.amp's autocast, then ``mixprec.prepare`` at a level with a state precision) and each form
of the user's optimizer (AdamW's default, on the CPU a loop over the parameters; ``foreach=True``; ``fused=True``;
SGD with momentum), on a small pre-norm transformer (the bench's :class:`~mixprec.bench.workloads.TinyLM`):

* **ops per optimizer step**: what ``optimizer.step()`` dispatches, at 2 and at 8 blocks: the aten ops called
  outside any other aten op, and each compiled graph or mixprec CPU kernel as one (the profiler's view; on a GPU
  each is a kernel launch or more). A step whose count grows with the blocks launches per parameter.
* **host reads in a whole step** (zero_grad, forward, backward, step): ``_local_scalar_dense`` (``.item()``,
  ``float(t)``, ``bool(t)``) of any tensor but an optimizer's step counter that torch keeps on the host (a
  non-fused, non-capturable optimizer's): on a GPU each is a device-to-host sync that blocks CUDA graph
  capture.
* **step time**: the median of whole training steps, the recipes of one optimizer form interleaved step by step,
  as a ratio to torch.amp's with the same optimizer (above 1: faster).

Counting runs the step under the profiler and under a dispatch mode, not in the timed steps. Nothing here is a
test: ratios from one run on a shared machine are figures to read, not thresholds.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec._src import profiling
from mixprec.bench.workloads import TinyLM

__all__ = [
    "COMPILED_HEADER",
    "HEADER",
    "OPTIMIZERS",
    "RECIPES",
    "CompiledRow",
    "Recipe",
    "Row",
    "compiled_table_rows",
    "count_ops",
    "host_reads",
    "measure",
    "measure_compiled",
    "table_rows",
]

#: the forms of the user's optimizer: ``name -> (class, keyword arguments)``
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "adamw-foreach": (torch.optim.AdamW, {"lr": 1e-3, "foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One way to train: torch.amp's autocast (``level`` None) or ``mixprec.prepare`` with these options."""

    name: str
    level: str | None = None
    optimizer_state: str = "fp32"
    step_in_backward: bool = False

    def build(
        self, blocks: int, dim: int, optimizer: str, device: torch.device | str = "cpu"
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model: nn.Module = TinyLM(256, dim, blocks, heads=max(1, dim // 16)).to(device)
        kind, options = OPTIMIZERS[optimizer]
        opt = kind(model.parameters(), **options)
        if self.level is not None:
            model, opt = mixprec.prepare(
                model,
                opt,
                level=self.level,
                optimizer_state=self.optimizer_state,
                step_in_backward=self.step_in_backward,
            )
        return model, opt


RECIPES: tuple[Recipe, ...] = (
    Recipe("torch-amp"),
    Recipe("O1", "O1"),
    Recipe("O2", "O2"),
    Recipe("bf16-pure", "bf16-pure"),
    Recipe("bf16-sr", "bf16-sr"),
    Recipe("bf16-kahan", "bf16-kahan"),
    Recipe("O2 bf16 state", "O2", "bf16"),
    Recipe("O2 8bit state", "O2", "8bit"),
    Recipe("bf16-sr bf16 state", "bf16-sr", "bf16"),
    Recipe("bf16-sr 8bit state", "bf16-sr", "8bit"),
    Recipe("bf16-sr 4bit state", "bf16-sr", "4bit"),
    Recipe("bf16-sr fp8 state", "bf16-sr", "fp8"),
    Recipe("bf16-sr in backward", "bf16-sr", step_in_backward=True),
)


@dataclasses.dataclass
class Row:
    recipe: str
    optimizer: str
    ops: tuple[int, int]  # optimizer.step()'s ops at 2 and 8 blocks
    host_reads: int
    step_ms: float
    opt_step_ms: float
    vs_torch_amp: float | None = None


HEADER = (
    "recipe",
    "optimizer",
    "step ops (2 -> 8 blocks)",
    "host reads",
    "step ms",
    "optimizer.step ms",
    "vs torch-amp",
)
_SIZES = {"tiny": (64, 4, 32, 4), "default": (256, 8, 128, 4)}  # width, batch, sequence, blocks timed


def _batch(batch: int, seq: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _forward_backward(
    model: nn.Module, opt: torch.optim.Optimizer, recipe: Recipe, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    inputs, targets = batch
    opt.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=recipe.level is None):
        logits = model(inputs)
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()  # type: ignore[no-untyped-call]


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, recipe: Recipe, batch: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """One training step; the seconds ``optimizer.step()`` took (on a GPU, waited for: a benchmark's sync, not
    the step's)."""
    _forward_backward(model, opt, recipe, batch)
    _wait(batch[0])
    start = time.perf_counter()
    opt.step()
    _wait(batch[0])
    return time.perf_counter() - start


def _wait(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _is_counted(event: Any) -> bool:
    name: str = event.name
    return name.startswith("aten::") or name.startswith("## Call CompiledFxGraph") or name.startswith("mixprec::")


def count_ops(step: Callable[[], Any]) -> int:
    """The ops ``step()`` dispatches: aten ops called outside another aten op, and each compiled graph or mixprec
    CPU kernel as one (under the profiler: nothing runs another way)."""
    prof = profiling.profiled(step)
    counted = 0
    for event in prof.events():
        if not _is_counted(event):
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_counted(parent):
            parent = parent.cpu_parent
        counted += parent is None
    return counted


class _Reads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts ``_local_scalar_dense`` of tensors other than ``host_side`` (data pointers)."""

    def __init__(self, host_side: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.host_side, self.reads = host_side, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].data_ptr() not in self.host_side:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _host_side_counters(opt: torch.optim.Optimizer) -> set[int]:
    """The step counters torch keeps on the host on a GPU: a non-fused, non-capturable optimizer's."""
    counters = set()
    for group in opt.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                counters.add(step.data_ptr())
    return counters


def host_reads(step: Callable[[], Any], opt: torch.optim.Optimizer) -> int:
    """The device-to-host reads of ``step()`` (a dispatch mode around it), counters kept on the host aside."""
    mode = _Reads(_host_side_counters(opt))
    with mode:
        step()
    return mode.reads


def measure(
    recipes: Iterable[Recipe] = RECIPES,
    optimizers: Iterable[str] = tuple(OPTIMIZERS),
    size: str = "tiny",
    steps: int = 20,
    progress: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
    finished: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """The step-cost rows: every recipe with every optimizer form (SGD only where its state precision applies);
    ``finished`` is handed each optimizer form's rows as they are measured."""
    dim, batch_size, seq, blocks = _SIZES[size]
    batch = _batch(batch_size, seq, device)
    recipes = tuple(recipes)
    rows: list[Row] = []
    for optimizer in optimizers:
        chosen = [r for r in recipes if optimizer != "sgd" or r.optimizer_state in ("fp32", "bf16", "8bit")]
        counts: dict[str, tuple[tuple[int, int], int]] = {}
        for recipe in chosen:
            if progress is not None:
                progress(f"{optimizer}: counting {recipe.name}")
            ops = []
            for n in (2, 8):
                model, opt = recipe.build(n, dim, optimizer, device)
                for _ in range(2):  # state made, kernels compiled
                    _train_step(model, opt, recipe, batch)
                _forward_backward(model, opt, recipe, batch)
                ops.append(count_ops(opt.step))
                if n == 8:
                    reads = host_reads(functools.partial(_train_step, model, opt, recipe, batch), opt)
            counts[recipe.name] = ((ops[0], ops[1]), reads)
        runs = {r.name: (r, *r.build(blocks, dim, optimizer, device)) for r in chosen}
        whole: dict[str, list[float]] = {name: [] for name in runs}
        inner: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(steps + 3):
            if progress is not None:
                progress(f"{optimizer}: timing, step {i + 1} of {steps + 3}")
            order = list(runs.values()) if i % 2 == 0 else list(reversed(runs.values()))
            for recipe, model, opt in order:
                start = time.perf_counter()
                opt_s = _train_step(model, opt, recipe, batch)  # waited for at its end
                if i >= 3:
                    whole[recipe.name].append(time.perf_counter() - start)
                    inner[recipe.name].append(opt_s)
        base = statistics.median(whole["torch-amp"]) if "torch-amp" in whole else None
        form: list[Row] = []
        for name, (ops_pair, reads) in counts.items():
            median = statistics.median(whole[name])
            form.append(
                Row(
                    name,
                    optimizer,
                    ops_pair,
                    reads,
                    1e3 * median,
                    1e3 * statistics.median(inner[name]),
                    None if base is None else base / median,
                )
            )
        rows += form
        if finished is not None:
            finished(form)
    return rows


#: the compiled table's columns
COMPILED_HEADER = ("recipe", "compiled step ms", "vs compiled torch-amp", "vs itself eager")


@dataclasses.dataclass
class CompiledRow:
    recipe: str
    step_ms: float
    vs_torch_amp: float | None
    vs_eager: float


def measure_compiled(
    recipes: Iterable[Recipe] = RECIPES,
    size: str = "tiny",
    steps: int = 20,
    progress: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
    backend: str = "inductor",
) -> tuple[list[CompiledRow], int, int]:
    """Whole training steps with ``torch.compile(model, backend=backend)`` (the optimizer's step eager, as each
    recipe steps it), fused AdamW, against compiled torch.amp and the same recipe eager, interleaved; the graphs
    dynamo compiled during the timed steps (recompiles: 0 when every recipe holds its graph) and the frames it
    gave up on, which ran eagerly (0 when every recipe ran compiled). Compiling takes tens of seconds a recipe
    on a CPU with inductor.

    From an empty compile cache (``torch._dynamo.reset()``), with dynamo's recompile limit raised by the number
    of recipes: each prepared model compiles graphs of its own (dynamo's guards hold the identity of the forwards
    ``prepare`` gives a model and its norms, so two instances share no graph, where two plain torch models do),
    all on the same few frames, and past the default limit (8) the later recipes would run eagerly. Module hooks
    are guarded, as ``bench.runner`` guards them."""
    dim, batch_size, seq, blocks = _SIZES[size]
    batch = _batch(batch_size, seq, device)
    recipes = tuple(r for r in recipes if not r.step_in_backward)  # its hooks run eagerly inside backward anyway
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit + 2 * len(recipes)
    with torch._dynamo.config.patch(recompile_limit=limit, skip_nnmodule_hook_guards=False):
        gave_up = _eager_frames()
        runs: dict[str, tuple[Recipe, nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]] = {}
        for recipe in recipes:
            if progress is not None:
                progress(f"compiling {recipe.name}")
            eager_model, eager_opt = recipe.build(blocks, dim, "adamw-fused", device)
            model, opt = recipe.build(blocks, dim, "adamw-fused", device)
            compiled = cast(nn.Module, torch.compile(model, backend=backend))
            for _ in range(2):
                _train_step(compiled, opt, recipe, batch)
                _train_step(eager_model, eager_opt, recipe, batch)
            runs[recipe.name] = (recipe, compiled, opt, eager_model, eager_opt)
        timed: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
        before = _frames()
        for i in range(steps):
            if progress is not None:
                progress(f"compiled: timing, step {i + 1} of {steps}")
            order = list(runs.values()) if i % 2 == 0 else list(reversed(runs.values()))
            for recipe, compiled, opt, eager_model, eager_opt in order:
                for which, (m, o) in enumerate(((compiled, opt), (eager_model, eager_opt))):
                    start = time.perf_counter()
                    _train_step(m, o, recipe, batch)
                    timed[recipe.name][which].append(time.perf_counter() - start)
        recompiled, gave_up = _frames() - before, _eager_frames() - gave_up
    base = statistics.median(timed["torch-amp"][0]) if "torch-amp" in timed else None
    rows = [
        CompiledRow(
            name,
            1e3 * statistics.median(c),
            None if base is None else base / statistics.median(c),
            statistics.median(e) / statistics.median(c),
        )
        for name, (c, e) in timed.items()
    ]
    return rows, recompiled, gave_up


def _eager_frames() -> int:
    """Frames dynamo has given up on so far in this process (they ran eagerly)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"].get("total", 0) - counters["frames"].get("ok", 0))


def _frames() -> int:
    """Graphs dynamo has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].get(key, 0) for key in ("unique_graphs",)))


def compiled_table_rows(rows: Iterable[CompiledRow]) -> list[tuple[str, ...]]:
    """The compiled rows as the cells of :data:`COMPILED_HEADER`."""
    return [
        (r.recipe, f"{r.step_ms:.2f}", "" if r.vs_torch_amp is None else f"{r.vs_torch_amp:.2f}x", f"{r.vs_eager:.2f}x")
        for r in rows
    ]


def table_rows(rows: Iterable[Row]) -> list[tuple[str, ...]]:
    """The rows as the cells of :data:`HEADER`."""
    return [
        (
            r.recipe,
            r.optimizer,
            f"{r.ops[0]} -> {r.ops[1]}",
            str(r.host_reads),
            f"{r.step_ms:.2f}",
            f"{r.opt_step_ms:.2f}",
            "" if r.vs_torch_amp is None else f"{r.vs_torch_amp:.2f}x",
        )
        for r in rows
    ]
