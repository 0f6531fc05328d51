"""Shared fixtures: every test starts and ends with autocast off in this thread."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from mixprec._src import autocast as autocast_module
from mixprec._src import dispatch as dispatch_module

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _clean_autocast_state() -> Iterator[None]:
    state = dispatch_module.state()
    assert not state.regions and not torch.is_autocast_enabled("cpu"), "a previous test left autocast on"
    yield
    for device_type in list(state.switched_on):
        autocast_module.set_autocast_enabled(device_type, False)
    assert not state.regions and not state.policy and not state.cache, "test left mixprec autocast state behind"
    assert not torch.is_autocast_enabled("cpu"), "test left torch autocast on"
    assert not dispatch_module.registered(), "test left mixprec kernels registered"


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


def spawn(fn: Any, world: int, *args: Any) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, port, results, *args)`` in ``world`` processes; each rank's ``results[rank]``."""
    import torch.multiprocessing as mp

    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(fn, args=(world, free_port(), results, *args), nprocs=world, start_method="spawn", join=True)
    return [dict(results[rank]) for rank in range(world)]


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


@pytest.fixture
def host_syncs() -> HostSyncs:
    """A :class:`HostSyncs` probe; ``with host_syncs: ...`` records the reads inside the block."""
    return HostSyncs()
