"""Fixtures: every test starts and ends with autocast off in this thread; each module starts on a settled heap;
a host-sync probe.

Helpers that tests import live in helpers.py."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from helpers import HostSyncs
from mixprec._src.amp import autocast as autocast_module
from mixprec._src.amp import dispatch as dispatch_module
from mixprec._src.amp import thread_state
from mixprec._src.fp8.gemm import onednn_off


@pytest.fixture(autouse=True)
def _clean_autocast_state() -> Iterator[None]:
    state = thread_state.state()
    assert not state.regions and not torch.is_autocast_enabled("cpu"), "a previous test left autocast on"
    yield
    for device_type in list(state.switched_on):
        autocast_module.set_autocast_enabled(device_type, False)
    assert not state.regions and not state.policy and not state.cache, "test left mixprec autocast state behind"
    assert not torch.is_autocast_enabled("cpu"), "test left torch autocast on"
    assert not dispatch_module.registered(), "test left mixprec kernels registered"


@pytest.fixture(scope="module", autouse=True)
def _settled_heap() -> None:
    """Each test module starts with the earlier modules' garbage collected and what they left alive frozen.

    The suite's process holds a million objects by its later modules (torch, inductor, compiled graphs);
    every full collection walks them all, and the bench's peak-memory probe collects before each run it
    measures: 60 s of the suite's collections were that walk. Frozen, the survivors are skipped by every
    later collection (still freed by reference counting); a module's own garbage is collected as before.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def host_syncs() -> HostSyncs:
    """A :class:`HostSyncs` probe; ``with host_syncs: ...`` records the reads inside the block."""
    return HostSyncs()


@pytest.fixture
def aten_fp8_gemm() -> Iterator[None]:
    """oneDNN off for the test: another library's ``torch._scaled_mm`` on the CPU then runs ATen's fp32 emulation,
    as mixprec's CPU fp8 GEMM always does (torch sends it to oneDNN on CPUs with AVX512-FP16, which sums in
    another order: a differential test compares the fp8 recipe, not two CPU backends)."""
    with onednn_off():
        yield
