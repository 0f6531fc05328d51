"""Peak memory of a stretch of work: on CUDA, ``torch.cuda.max_memory_allocated`` above the level at
start; on Linux CPUs, the peak resident set size above it, sampled every 2 ms from
``/proc/self/statm`` (allocator caching included: indicative), with glibc set to return freed
memory while measuring; elsewhere ``None``. Syncs with the device at start (CUDA).
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import torch

from mixprec.bench.devices import sync

__all__ = ["PeakMemory"]


def _glibc() -> Any:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _allocator_tracks_live_memory(on: bool) -> None:
    """Switch glibc between memory measurement and timing.

    On: large buffers are mmapped and returned to the OS when freed, so the resident set
    follows live tensor memory. Off (for timed runs): buffers up to 32 MiB are reused from the
    heap, as in a long training run; mmapping every activation would time page faults instead.
    """
    if _LIBC is None:
        return
    _LIBC.mallopt(_M_MMAP_THRESHOLD, 128 * 1024 if on else 32 * 1024 * 1024)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, 128 * 1024 if on else 256 * 1024 * 1024)
    if on:
        _LIBC.malloc_trim(0)


class PeakMemory:
    """Peak memory above the level at ``__enter__``: CUDA's max allocated, or the resident set sampled every 2 ms."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stop = threading.Event()
        self._peak = 0
        self._base = 0
        self._thread: threading.Thread | None = None
        self._statm = "/proc/self/statm" if os.path.exists("/proc/self/statm") else None

    def _rss(self) -> int:
        assert self._statm is not None
        with open(self._statm) as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, self._rss())

    def __enter__(self) -> PeakMemory:
        # an earlier run's tensors held in reference cycles would count in the level at start and, collected
        # mid-run, pull the peak below it (a CUDA run measured 0 MiB so)
        gc.collect()
        if self.device.type == "cuda":
            sync(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._statm is not None:
            _allocator_tracks_live_memory(True)
            self._base = self._peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _allocator_tracks_live_memory(False)

    @property
    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device) - self._base)
        if self._statm is None:
            return None
        return max(0, self._peak - self._base)
