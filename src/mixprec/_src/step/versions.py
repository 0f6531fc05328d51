"""The weights' version counters after a step that wrote them through pointers: :func:`move_as_torch`."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["move_as_torch"]


def move_as_torch(group: dict[str, Any], params: list[torch.Tensor]) -> None:
    """Move ``params``' version counters as the user's form of the optimizer moves them: torch's for-loop and
    foreach in-place ops do, its fused kernel does not (nor mixprec's step of a fused group). A one-call kernel writes
    the weights through their addresses, which moves nothing; this keeps what autograd reports the same as with
    torch's step (a weight written between a forward and its backward). Host-side counters: nothing syncs."""
    if params and not group.get("fused"):
        torch.autograd.graph.increment_version(params)
