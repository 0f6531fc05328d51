"""torch's profiler around a step, without the lines its C++ side prints on the process's stderr.

Kineto writes ``profiler_start`` / ``profiler_stop`` lines to file descriptor 2 as a profile starts and stops, past
``sys.stderr``: mixprec's commands print their own output only. Nothing here syncs beyond what profiling does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["profiled", "quiet_stderr"]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null (C++ writes there directly, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiled(step: Callable[[], Any], cuda: bool = False) -> Any:
    """``step()`` under torch's profiler (CPU activity, and CUDA's with ``cuda``), its start and stop silenced;
    the finished profile."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof: Any = torch.profiler.profile(activities=activities)
    with quiet_stderr():
        prof.__enter__()
    try:
        step()
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
    return prof
