"""FSDP2 all-gathers fp8 layers' weights in fp8: a quarter of fp32's bytes, half of bf16's.

``Fp8Config(all_gather=True)`` on a ``fully_shard`` model: each converted linear's weight shard
gets FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, set on the
shard itself, so the parameter, the optimizer and checkpoints keep plain tensors). Before the
gather each rank casts its shard to e4m3 with the weight's scale: the global amax (one all-reduce
of a number per gather, so it is never stale after a load or an in-place write) or, with delayed
scaling, the history's (identical on every rank). After the gather the weight is dequantized to
the unit's parameter dtype; the layer's forward then casts it back to the same fp8 values (a value
already on the fp8 grid, scaled by a scale within a rounding of the gather's, rounds to itself).
The all-gather moves bytes (uint8), which every backend carries.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from mixprec._src import sharding
from mixprec._src.fp8 import gemm as fp8_gemm
from mixprec._src.fp8.config import E4M3
from mixprec._src.fp8.conversion import Fp8Layers
from mixprec._src.fp8.linear import WEIGHT, Fp8Scaling, scale_from_history
from mixprec._src.gemms import kinds

__all__ = ["install"]


def install(model: torch.nn.Module, layers: Fp8Layers) -> int:
    """Give the weight shards of ``layers`` FSDP2's fp8 all-gather; returns how many got it."""
    scalings = {}
    for module in layers.modules.values():
        owner, param_name = kinds.weight_param(module)  # an attention's in-projection: its owner's in_proj_weight
        scalings[id(owner), param_name] = module.fp8
    count = 0
    for unit in sharding.fsdp_units(model):
        for fsdp_param in unit.fsdp_params:
            info = fsdp_param._module_info
            scaling = scalings.get((id(info.module), info.param_name))
            if isinstance(scaling, Fp8Scaling):
                _attach(fsdp_param, scaling)
                count += 1
    return count


def _weight_scale(shard: torch.Tensor, scaling: Fp8Scaling, group: Any) -> torch.Tensor:
    """The weight's scale on every rank: from the global amax now, or (delayed) from the history."""
    now = shard.detach().abs().amax().float() if shard.numel() else torch.zeros((), device=shard.device)
    dist.all_reduce(now, op=dist.ReduceOp.MAX, group=group)
    config = scaling.config
    if not config.delayed:
        return fp8_gemm.scale_from_amax(now, E4M3, power_of_two=False)
    return scale_from_history(scaling.history[WEIGHT], now, E4M3, config.amax_algo, config.margin)


def _attach(fsdp_param: Any, scaling: Fp8Scaling) -> None:
    shard = fsdp_param._sharded_local_tensor

    def pre_all_gather(
        mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        local = fsdp_param._sharded_local_tensor
        scale = _weight_scale(local, scaling, mesh.get_group())
        data = fp8_gemm.quantize(local, scale, E4M3)
        rows = math.ceil(outer_size[0] / mesh.size())  # an uneven last shard is padded to the others' size
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data.view(torch.uint8),), (scale,)

    def post_all_gather(
        outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: torch.Tensor | None = None
    ) -> Any:
        (data,), (scale,) = outputs, metadata
        weight = (data.view(E4M3).float() * scale.reciprocal()).to(param_dtype)
        if out is not None:  # a later gather of the same parameter: into its storage, outside autograd's count
            out.data.copy_(weight.view(out.shape))
            return None
        return weight, (weight,)

    shard.fsdp_pre_all_gather = pre_all_gather
    shard.fsdp_post_all_gather = post_all_gather
    fsdp_param._init_extensions()
