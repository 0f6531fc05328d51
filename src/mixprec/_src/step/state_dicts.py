"""An optimizer's quantized state in its state dict: the room codes take on a shard, the codes' global layout
in a saved state dict (FSDP2), a quantized checkpoint loaded into another state precision, and the state put
back in fp32 (``export_fp32``). Host-side hooks and copies; nothing here syncs with the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mixprec._src import sharding
from mixprec._src.optim import moments

__all__ = ["capacity", "dequantize_on_load", "keep_codes_on_load", "restore_fp32", "sharded_codes"]


def capacity(p: torch.Tensor) -> int:
    """Values each rank's shard of ``p`` makes room for: the first (largest) shard's under dim-0 sharding."""
    if not sharding.is_sharded(p):
        return p.numel()
    placements = p.placements  # type: ignore[attr-defined]
    if len(placements) != 1 or not placements[0].is_shard(0):
        raise ValueError(
            f"quantized optimizer state needs parameters sharded on dim 0 over one mesh dimension "
            f"(fully_shard's default); this one is {placements}: use optimizer_state='fp32'"
        )
    rows = -(-p.shape[0] // p.device_mesh.size())  # type: ignore[attr-defined]
    return int(rows * math.prod(p.shape[1:]))


def sharded_codes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict whose codes and scales of sharded parameters are DTensors sharded on dim 0 (each rank's
    local ones, of one length on every rank), as DCP saves sharded state; the optimizer's own state is kept."""
    from torch.distributed.tensor import DTensor, Shard

    by_index = _params_by_index(optimizer, state_dict)
    state = dict(state_dict["state"])
    for index, entry in state.items():
        param = by_index.get(index)
        if param is None or not sharding.is_sharded(param) or not moments.is_quantized(entry):
            continue
        mesh = param.device_mesh  # type: ignore[attr-defined]
        wrapped = {}
        for key, value in entry.items():
            if key.endswith(("_codes", "_scale")):
                whole = torch.Size([value.shape[0] * mesh.size()])
                wrapped[key] = DTensor.from_local(value, mesh, [Shard(0)], run_check=False, shape=whole, stride=(1,))
        state[index] = {**entry, **wrapped}
    return {**state_dict, "state": state}


def dequantize_on_load(optimizer: torch.optim.Optimizer, handles: list[Any]) -> None:
    """An optimizer whose state is kept as the level keeps it (``optimizer_state="fp32"``) loads a checkpoint of
    quantized state as its moments dequantized, in its parameter's dtype (as ``load_state_dict`` casts any state):
    torch's step would otherwise find codes and no moments (``KeyError: 'exp_avg'``)."""

    def widened(state: dict[str, Any], param: torch.Tensor) -> None:
        local = sharding.local(param)
        moments.fp32_state(state, local.shape)
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.to(local.dtype)

    keep_codes_on_load(optimizer, handles, widened)


def keep_codes_on_load(
    optimizer: torch.optim.Optimizer,
    handles: list[Any],
    then: Callable[[dict[str, Any], torch.Tensor], None] | None = None,
) -> None:
    """``load_state_dict`` casts every state tensor but ``step`` to its parameter's dtype (uint8 codes and fp32
    scales would become floats, bf16 at the bf16 levels): the codes and scales are set aside before the
    load and put back after it, as saved (the checkpoint's own dict is not changed); ``then(state, param)``
    after, for each state that had them."""
    aside: dict[Any, dict[str, torch.Tensor]] = {}
    owners: dict[Any, torch.Tensor] = {}

    def before(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        aside.clear()
        owners.clear()
        owners.update(_params_by_index(opt, state_dict))
        state = {}
        for index, entry in state_dict["state"].items():
            if isinstance(entry, dict) and moments.is_quantized(entry):
                aside[index] = {k: v for k, v in entry.items() if k.endswith(("_codes", "_scale"))}
                entry = {k: v for k, v in entry.items() if k not in aside[index]}
            state[index] = entry
        return {**state_dict, "state": state}

    def after(opt: torch.optim.Optimizer) -> None:
        for index, tensors in aside.items():
            param = owners[index]
            opt.state[param].update({k: sharding.local(v).to(param.device) for k, v in tensors.items()})
            if then is not None:
                then(opt.state[param], param)
        aside.clear()

    handles.append(optimizer.register_load_state_dict_pre_hook(before))  # type: ignore[arg-type]
    handles.append(optimizer.register_load_state_dict_post_hook(after))


def _params_by_index(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[Any, torch.Tensor]:
    """The optimizer's parameter each index of ``state_dict`` names, as ``load_state_dict`` pairs them (in order)."""
    order = [i for g in state_dict["param_groups"] for i in g["params"]]
    # not strict: a state dict of another shape is load_state_dict's to refuse, with its own message
    return dict(zip(order, (p for g in optimizer.param_groups for p in g["params"]), strict=False))


def restore_fp32(optimizer: torch.optim.Optimizer) -> None:
    """Every quantized state of ``optimizer`` back to fp32 moments (in place), as torch's Adam keeps them."""
    for param, state in optimizer.state.items():
        moments.fp32_state(state, param.shape)  # type: ignore[union-attr]
