"""What :func:`mixprec.prepare` checks: the model and optimizer it is given, and before each step that they are
still what it set up (a model sharded since, parameters replaced). Host-side only: nothing here syncs."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from mixprec._src import input_checks, sharding
from mixprec._src.errors import PrepareOrderError

__all__ = [
    "Fingerprint",
    "NoCopy",
    "check_model_and_optimizer",
    "check_not_sharded_since",
    "check_still_ours",
    "check_wrapping",
]


class _Prepared(Protocol):
    sharded: bool  # prepare set up FSDP2 units


def check_wrapping(model: nn.Module) -> None:
    if sharding.uses_fsdp1(model):
        raise ValueError(
            "this model is wrapped in FullyShardedDataParallel (FSDP1), whose flat parameters mixprec.prepare "
            "cannot set up; use FSDP2 instead: torch.distributed.fsdp.fully_shard(module) on each block and on the "
            "model, build the optimizer, then mixprec.prepare(model, optimizer, level=...)"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "prepare the module before wrapping it in DistributedDataParallel: "
            "model, opt = mixprec.prepare(model, opt, level=...); model = DDP(model)"
        )


def check_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> None:
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype is not torch.float32]
    if low:
        raise ValueError(
            f"prepare() needs an fp32 model to make exact fp32 masters, but {low[0][0]!r} is {low[0][1]}; "
            "call prepare() on the fp32 model instead of converting it first"
        )
    model_params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                if sharded:
                    raise ValueError(
                        "the optimizer holds a tensor that is not a parameter of this model: fully_shard replaces each "
                        "parameter with a sharded one, so build the optimizer from model.parameters() after fully_shard"
                    )
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of this model (was the optimizer created "
                    "before the model was moved or copied?); create it from model.parameters() after moving the model"
                )
            if id(p) in seen:
                raise ValueError("a parameter appears in two optimizer param groups; give each parameter one group")
            seen.add(id(p))


def check_not_sharded_since(model: nn.Module, state: _Prepared) -> None:
    """Refuse a model ``fully_shard`` was applied to after prepare set it up unsharded."""
    if not state.sharded and sharding.fsdp_modules(model):
        raise PrepareOrderError(
            "fully_shard was applied after mixprec.prepare, which set the model and optimizer up unsharded (a "
            "prepared optimizer would step tensors the model no longer uses); the order is: fully_shard, build the "
            "optimizer, then mixprec.prepare(model, optimizer, level=...)"
        )


class Fingerprint:
    """The model's modules' classes, its parameters where they sit and the tensors the optimizer steps, as a
    check last found them: while they are the same, the next check has nothing to walk (a walk of the model's
    modules and parameters at every step cost a tenth of a millisecond on a small model)."""

    def __init__(self) -> None:
        self.classes: list[tuple[nn.Module, type]] = []
        self.slots: list[tuple[dict[str, Any], str, Any]] = []
        self.stepped: list[int] = []

    @staticmethod
    def _stepped(optimizer: torch.optim.Optimizer) -> list[int]:
        return [id(p) for group in optimizer.param_groups for p in group["params"]]

    def same(self, optimizer: torch.optim.Optimizer) -> bool:
        # fully_shard changes a module's class; load_state_dict(assign=True) and to_empty replace parameters
        return (
            self._stepped(optimizer) == self.stepped
            and all(type(m) is c for m, c in self.classes)
            and all(d.get(n) is p for d, n, p in self.slots)
        )

    def take(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        modules = list(model.modules())
        self.classes = [(m, type(m)) for m in modules]
        self.slots = [(m._parameters, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        self.stepped = self._stepped(optimizer)


def check_still_ours(
    model: nn.Module, state: _Prepared, seen: Fingerprint, optimizer: torch.optim.Optimizer, *_: Any
) -> None:
    """Before each step: the optimizer still steps the model's parameters (a host-side check, no sync)."""
    if seen.same(optimizer):
        return
    check_not_sharded_since(model, state)
    if not input_checks.holds_only_parameters_of(optimizer, model):
        raise PrepareOrderError(
            "the prepared optimizer steps tensors that are no longer this model's parameters (they were replaced "
            "after mixprec.prepare: fully_shard, load_state_dict(assign=True), to_empty); set the model up first, "
            "then build the optimizer and call mixprec.prepare"
        )
    seen.take(model, optimizer)


def _refuse_copy(*_: Any) -> Any:
    raise PrepareOrderError(
        "a prepared optimizer cannot be copied or pickled: torch.optim.Optimizer copies only its defaults, state and "
        "param groups, so the copy would step without what mixprec.prepare installed (bf16-sr's stochastic rounding, "
        "the state precisions, the clipping) and its state_dict would leave out their seeds and counters. Save "
        "optimizer.state_dict() and load it into an optimizer prepared the same way, or copy the model and the "
        "optimizer before mixprec.prepare and prepare the copy"
    )


class NoCopy:
    """A prepared optimizer refuses ``copy.copy``, ``copy.deepcopy`` and pickling (``torch.save(optimizer)``) with
    an error that says what to do, instead of a copy that steps as a plain torch optimizer (see
    :func:`_refuse_copy`). ``remove()`` (``export_fp32``) lifts it."""

    KEYS = ("__deepcopy__", "__reduce_ex__")  # looked up on the instance by copy and pickle

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        for key in self.KEYS:
            optimizer.__dict__[key] = _refuse_copy

    def remove(self) -> None:
        for key in self.KEYS:
            if self.optimizer.__dict__.get(key) is _refuse_copy:
                del self.optimizer.__dict__[key]
