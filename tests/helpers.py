"""What tests share: comparisons, small models and training loops, real process groups, sync probes.

Fixtures live in conftest.py; everything a test imports lives here (``from helpers import ...``).
"""

from __future__ import annotations

import importlib.util
import io
import pathlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec

_T = TypeVar("_T")


ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_script(path: str) -> ModuleType:
    """A script of the repository that is not a package module (``tools/mutants.py``, ``benchmarks/...``),
    imported by its path; registered in ``sys.modules`` under its file name (its dataclasses look it up)."""
    name = pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def requires_cuda(test: _T) -> _T:
    """Skip ``test`` without a CUDA GPU, and mark it ``cuda``: ``pytest -m cuda`` (``make gpu-check``) runs these."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.resolve_neg().contiguous().view(_BITS[t.element_size()])


def bitwise_equal(a: object, b: object) -> bool:
    """Same structure, dtypes and shapes, and floating values equal bit for bit (NaN payloads too)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point() or a.is_complex():
            return torch.equal(_bits(a), _bits(b))
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def sqnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``reference``, in dB (torchao's ``compute_error``)."""
    x, reference = x.double(), reference.double()
    return float(20 * torch.log10(reference.norm() / (x - reference).norm()))


def square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


class Overflowing(nn.Module):
    """A planted range problem: ``big`` produces activations past fp16's 65504; the LayerNorm
    after it brings them back (diagnose and tune must keep ``big`` in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.big = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.big(self.inp(x))))


# --- real process groups: spawned workers on gloo, results handed back through a manager ----------


def free_port() -> int:
    """A TCP port free on this machine now (each spawned group gets its own)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world: int, port: int) -> None:
    """Join a gloo group of ``world`` processes on this machine, one thread each."""
    import os

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


# What every worker imports, imported once: the workers are forked from a server process that has them (and
# has run nothing: no thread pool to inherit), not started as new interpreters that import torch each time.
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "mixprec", "helpers"]


def _worker_context() -> Any:
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts: the suite's first group
    return context


def spawn(fn: Any, world: int, *args: Any) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, port, results, *args)`` in ``world`` processes; each rank's ``results[rank]``.

    A Python error in a worker fails at once. A worker killed by a signal (a native crash: glibc's
    "double free or corruption" abort has been seen, rarely, in a gloo worker of a group whose every
    other run passes) is said in a warning and the group run again, once; if every rank had already
    handed back its results before the crash (the group's shutdown), they are kept.
    """
    import warnings

    import torch.multiprocessing as mp

    context = _worker_context()
    for attempt in range(2):
        manager = context.Manager()
        results = manager.dict()
        try:
            mp.start_processes(fn, args=(world, free_port(), results, *args), nprocs=world, start_method="forkserver")
        except mp.ProcessExitedException as crash:
            if crash.signal_name is None or attempt == 1:
                raise
            done = len(results) == world
            warnings.warn(f"spawned rank {crash.error_index} died by {crash.signal_name} "
                          + ("after handing back its results: kept" if done else "mid-run: the group runs again"),
                          UserWarning, stacklevel=2)  # fmt: skip
            if not done:
                continue
        return [dict(results[rank]) for rank in range(world)]
    raise AssertionError("unreachable")


# --- host syncs: every way Python reads a tensor's values back --------------------------------------

# Tensor methods and torch functions whose result is a Python value computed from a tensor's data:
# on a GPU each waits for the device. (CPU tensors do not wait, but the same code paths run there,
# so counting their calls on a CPU shows what would sync on a GPU.)
_SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy",
                 "__array__", "nonzero", "cpu", "equal", "allclose", "is_nonzero")  # fmt: skip
_SYNC_FUNCTIONS = ("equal", "allclose", "nonzero", "is_nonzero", "unique", "masked_select")


class HostSyncs:
    """Records each host read of tensor data inside a ``with`` block: ``(name, tensor)`` in ``reads``."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, torch.Tensor]] = []
        self._monkeypatch = pytest.MonkeyPatch()  # its own: undoing it leaves the test's patches alone

    def __enter__(self) -> HostSyncs:
        self.reads = []  # each block counts its own
        for name in _SYNC_METHODS:
            original = getattr(torch.Tensor, name, None)
            if original is not None:
                self._monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))
        for name in _SYNC_FUNCTIONS:
            self._monkeypatch.setattr(torch, name, self._wrap(f"torch.{name}", getattr(torch, name)))
        return self

    def _wrap(self, name: str, original: Any) -> Any:
        def read(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.reads.append((name, tensor))
            return original(tensor, *args, **kwargs)

        return read

    def __exit__(self, *exc: object) -> None:
        self._monkeypatch.undo()

    def names(self, ignore: tuple[torch.Tensor, ...] = ()) -> list[str]:
        """The reads, by name, except of the tensors in ``ignore`` (host-side by design)."""
        return [name for name, tensor in self.reads if not any(tensor is t for t in ignore)]


class OpNames(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode recording the name of each op it sees (``names``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def step_ops_at(
    recipe: Any, width: int, blocks: tuple[int, ...] = (2, 8), optimizer: str = "adamw-fused"
) -> tuple[list[int], nn.Module, Any]:
    """``optimizer.step()``'s ops (``bench.step_cost.count_ops``) of ``recipe`` (a ``step_cost.Recipe``) on the bench
    transformer of ``width`` at each of ``blocks``, after two training steps, with ``optimizer`` (a form of
    ``step_cost.OPTIMIZERS``, fused AdamW by default); the last model and optimizer built."""
    from mixprec.bench import step_cost

    batch = step_cost._batch(2, 8)
    ops = []
    for n in blocks:
        model, opt = recipe.build(n, width, optimizer)
        for _ in range(2):
            step_cost._train_step(model, opt, recipe, batch)
        step_cost._forward_backward(model, opt, recipe, batch)
        ops.append(step_cost.count_ops(opt.step))
    return ops, model, opt


# --- GradScaler runs: a small classifier in fp16 autocast, with overflows planted ---


SCALERS = {"torch": torch.amp.GradScaler, "mixprec": mixprec.GradScaler}


# Iteration -> what to plant in one gradient after backward: overflow, NaN, and a run of two.
INJECT = {1: float("inf"), 4: float("nan"), 7: float("inf"), 8: float("-inf")}


def scaler_model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 4))


def class_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def plant_overflow(params: list[nn.Parameter], step: int) -> None:
    if step in INJECT and params[0].grad is not None:
        params[0].grad.view(-1)[0] = INJECT[step]


def small_scaler(kind: str, **kwargs: Any) -> Any:
    return SCALERS[kind]("cpu", init_scale=2.0**10, growth_interval=3, **kwargs)


def fp16_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def train_some(scaler: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    batches = class_batches(steps.stop)
    for i in steps:
        x, y = batches[i]
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        plant_overflow(list(model.parameters()), i)
        scaler.step(opt)
        scaler.update()


def scaled_backward(scaler: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = class_batches(1)[0]
    scaler.scale(fp16_loss(model, x, y)).backward()
    return model, opt


def constant_run(scaler: mixprec.GradScaler, plant: Callable[[int], bool], steps: int) -> list[float]:
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for i, (x, y) in enumerate(class_batches(steps)):
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        if plant(i):
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


# --- prepare runs: a small regression MLP ---


def regression_model(seed: int = 0, norm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, 64)]
    if norm:
        layers.append(nn.LayerNorm(64))
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def regression_data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 1, generator=g) / 4
    batches = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=g)
        batches.append((x, torch.sin(x @ teacher)))
    return batches


def state_mlp() -> nn.Module:
    """The optimizer-state tests' model: three weights of 4096 values or more (their state kept in low precision),
    biases under it (kept as the level keeps them)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))


def state_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches for :func:`state_mlp`: a sum of sines of the inputs."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        out.append((x, x[:, :8].sin().sum(1, keepdim=True)))
    return out


def resumed(
    model: nn.Module, optimizer: torch.optim.Optimizer, fresh: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A checkpoint's round trip: ``model``'s and ``optimizer``'s state dicts through ``torch.save`` and
    ``torch.load`` (bytes, as a file holds them), loaded into ``fresh()``'s; returns those and what was saved."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved: dict[str, Any] = torch.load(buffer)
    model, optimizer = fresh()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return model, optimizer, saved


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (a sharded one gathered), in fp32, detached copies."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone() for p in model.parameters()]


def weights_seen(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
    """Each module's weight as its own forward sees it (dtype and value), recorded by a hook."""
    seen: dict[str, tuple[torch.dtype, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if "weight" in module._parameters:
            module.register_forward_pre_hook(
                lambda m, a, name=name: seen.__setitem__(name, (m.weight.dtype, m.weight.detach().clone()))
            )
    return seen


def one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = regression_data(1)[0]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


# --- autocast ---


def mm_dtype() -> torch.dtype:
    return torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype


def train_next_token(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int, *,
                     vocab: int = 64, seq: int = 16, batch: int = 8,
                     after_step: Callable[[], None] | None = None) -> list[float]:  # fmt: skip
    """Next-token training on seeded random tokens (step ``s`` draws the same batch everywhere), each rank its
    share of the batch; returns each step's loss averaged over ranks (an all-reduce where ``world > 1``)."""
    import torch.distributed as dist

    losses = []
    for step in steps:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(100 + step))
        x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        if after_step is not None:
            after_step()
    return losses


def with_and_without_step_copies(
    monkeypatch: pytest.MonkeyPatch, run: Callable[[bool], tuple[nn.Module, list[torch.Tensor]]]
) -> None:
    """``run(written)`` twice, returning the model it trained and its forwards' outputs: with O2's copies written by
    the step's kernels, then with none written by any step (``own_step.writable_copy`` finds none: each forward after
    a step copies every master); the masters and every output bit for bit alike."""
    from mixprec._src.step import own_step

    runs = []
    for written in (True, False):
        if not written:
            monkeypatch.setattr(own_step, "writable_copy", lambda *_: None)
        runs.append(run(written))
        monkeypatch.undo()
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)
