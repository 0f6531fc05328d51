"""The bench's PeakMemory: the peak above the level at its start, garbage from before left out."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from mixprec.bench.peak_memory import PeakMemory


class _Cycle:
    """A reference cycle holding a tensor: alive until the collector runs."""

    def __init__(self, values: int) -> None:
        self.me = self
        self.tensor = torch.ones(values)


def test_garbage_collected_mid_run_does_not_hide_the_peak() -> None:
    """An earlier run's tensors in reference cycles, collected during the measured run, must not count in the
    level at the start (the run's own 50 MB would then read as 0: seen on a GPU for torch-amp's transformer)."""
    if PeakMemory(torch.device("cpu")).peak_bytes is None:
        pytest.skip("no /proc/self/statm here")
    gc.disable()
    try:
        _Cycle(50_000_000)  # 200 MB of garbage
        with PeakMemory(torch.device("cpu")) as memory:
            gc.collect()  # the collector runs mid-run
            held = torch.ones(12_500_000)  # 50 MB
            time.sleep(0.05)  # sampled every 2 ms
            del held
    finally:
        gc.enable()
    assert memory.peak_bytes is not None
    assert 45e6 < memory.peak_bytes < 80e6, memory.peak_bytes
