"""Whether a Python dispatch mode is active: compiled kernels cannot run under one.

``torch.compile``d functions refuse to run while a non-infrastructure ``TorchDispatchMode`` is on the stack
(``FlopCounterMode``, what MFU counters and Lightning's ``measure_flops`` use; a user's own mode). mixprec's
compiled optimizer kernels ask :func:`active` at each step and run their eager form there instead: the same
update, op by op, which the mode then sees. A host-side check of a thread-local stack: no sync.
"""

from __future__ import annotations

import torch

__all__ = ["active"]


def active() -> bool:
    """Whether a Python ``TorchDispatchMode`` is on this thread's dispatch-mode stack now."""
    return bool(torch._C._len_torch_dispatch_stack())
