"""Memory a training state holds on this rank: weights, low-precision copies, gradients, optimizer state.

``mixprec.memory_report(model, optimizer)`` counts exact bytes of the tensors themselves
(each storage once), not the allocator's view: what a precision level and sharding change.
Sharded tensors (FSDP2's DTensors) count their local shard. Nothing here syncs with the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mixprec._src import sharding
from mixprec._src.prepare.levels import prepared_state

__all__ = ["MemoryReport", "memory_report"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of training state held on one rank.

    Attributes:
        parameters: the weights the forward computes with, held between steps: the model's
            parameters, or at O2 their low-precision copies (FSDP2 gathers those only around each
            forward and backward: counted while gathered, 0 between steps).
        masters: fp32 master weights kept beside low-precision ones (O2: the fp32 parameters).
        gradients: the parameters' gradients.
        optimizer_state: tensors in the optimizer's state (moments, step counts).
        replicated: the part of the total held whole on every rank of a sharded model (tensors
            that are not DTensors, or replicated ones): what sharding does not divide.
        rank: this process's rank (0 without a process group).
        world_size: the number of ranks (1 without a process group).
    """

    parameters: int
    masters: int
    gradients: int
    optimizer_state: int
    replicated: int
    rank: int = 0
    world_size: int = 1

    @property
    def total(self) -> int:
        """Every byte above, once."""
        return self.parameters + self.masters + self.gradients + self.optimizer_state

    def to_dict(self) -> dict[str, int]:
        """Plain data (with ``total``), for JSON."""
        return {**dataclasses.asdict(self), "total": self.total}

    def __str__(self) -> str:
        mib = 1 << 20
        kinds = {
            "parameters": self.parameters,
            "masters": self.masters,
            "gradients": self.gradients,
            "optimizer state": self.optimizer_state,
        }
        parts = ", ".join(f"{name} {value / mib:.1f} MiB" for name, value in kinds.items())
        return f"rank {self.rank}/{self.world_size}: {parts}; total {self.total / mib:.1f} MiB"


def _bytes(t: torch.Tensor, replicated: list[int]) -> int:
    held = sharding.local(t)
    size = held.numel() * held.element_size()
    if not sharding.is_sharded(t) or all(p.is_replicate() for p in t.placements):  # type: ignore[attr-defined]
        replicated[0] += size
    return size


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Bytes this rank holds for ``model`` and ``optimizer``, by kind (each tensor counted once).

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model, opt = mixprec.prepare(model, opt, level="O2")
        >>> report = mixprec.memory_report(model, opt)
        >>> report.masters == 4 * (256 * 256 + 256), report.parameters == 2 * (256 * 256 + 256)
        (True, True)
    """
    state = prepared_state(model)
    copies = state.copies if state is not None else None
    lowp = {id(p) for p in state.lowp_params} if state is not None and state.level.value == "O2" else set()
    seen: set[int] = set()
    replicated = [0]
    parameters = masters = gradients = optimizer_state = 0

    def once(t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            return False
        seen.add(id(t))
        return True

    params = list(model.parameters())
    if optimizer is not None:
        params += [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if once(p):
            if id(p) in lowp:
                masters += _bytes(p, replicated)
            else:
                parameters += _bytes(p, replicated)
        if p.grad is not None and once(p.grad):
            gradients += _bytes(p.grad, replicated)
    if copies is not None:
        for held in copies.copies.values():
            if once(held):
                parameters += _bytes(held, replicated)
    for unit in sharding.fsdp_units(model):  # parameters FSDP2 holds gathered right now
        for fp in unit.fsdp_params:
            gathered = getattr(fp, "_unsharded_param", None)
            if gathered is not None and once(gathered):
                parameters += gathered.untyped_storage().nbytes()
    if optimizer is not None:
        for param_state in optimizer.state.values():
            for value in param_state.values():
                if once(value):
                    optimizer_state += _bytes(value, replicated)
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return MemoryReport(parameters, masters, gradients, optimizer_state, replicated[0], rank, world)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in parameters, their gradients, low-precision copies and optimizer state."""
    return memory_report(model, optimizer).total
