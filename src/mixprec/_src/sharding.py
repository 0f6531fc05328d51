"""FSDP2 (``fully_shard``) under :func:`mixprec.prepare`: each level as FSDP2's own mixed precision.

With FSDP2 each rank holds a shard of every parameter and all-gathers the whole parameter
around its module's forward and backward. :func:`mixprec.prepare`, called after
``fully_shard`` and after the optimizer is built (the order FSDP2 asks for), sets each
sharded unit up for its level before the first forward, when FSDP2 reads these settings:

* O2: the sharded fp32 parameters are the master weights. FSDP2 all-gathers them in the low
  precision and reduce-scatters gradients in fp32 (``MixedPrecisionPolicy(param_dtype=dtype,
  reduce_dtype=torch.float32)``), so masters, gradients and optimizer state stay sharded and
  what each rank gathers is low precision.
* bf16-sr, bf16-pure: the shards themselves are bf16; gradients are reduced in fp32 (and
  accumulated in fp32 while gradient sync is off), then stored in bf16. Stochastic rounding
  rounds each rank's own shard, element by element as one process would.
* O1: nothing to set; autocast casts the gathered fp32 parameters.

At the bf16 levels a unit stores one dtype and reduces its gradients in one dtype, so the
modules kept in fp32 inside a low-precision unit (the norms inside a transformer block) move
together into one unit of their own on the same mesh, gathered and reduced in fp32, not resharded
between forward and backward (norms are small): one more all-gather and reduce-scatter per unit.

This reaches into FSDP2's units (their mixed-precision policy, before the first forward reads it,
and two methods of the parameters O2 gathers in fp32); the suite checks it against the torch it
pins. Collectives: :func:`split_kept_units` all-gathers each kept module's parameters once.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["fsdp_units", "flat_offset", "local", "lazily_initialized", "set_unit_precision", "split_kept_units"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return None
    return DTensor


_DTensor = _dtensor_type()


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a shard of a tensor spread over ranks)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (``t`` itself unless it is a DTensor)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined,no-any-return]


def flat_offset(t: torch.Tensor) -> tuple[int, bool] | None:
    """Where this rank's shard of ``t`` starts in the whole tensor, flattened; ``None`` if ``t`` is whole.

    Returns ``(offset, contiguous)``: ``contiguous`` when the shard is one run of the whole
    tensor's elements (split along dim 0 only, FSDP2's way), so element ``i`` of the shard is
    element ``offset + i`` of the whole.
    """
    if not is_sharded(t):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(t.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    offset = sum(o * s for o, s in zip(offsets, strides, strict=True))
    return int(offset), tuple(local_shape[1:]) == shape[1:]


# ----- FSDP2's units -----------------------------------------------------------------------


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


_FSDPModule = _fsdp_module_type()


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return _FSDPModule is not None and isinstance(module, _FSDPModule)


def uses_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is or holds the older ``FullyShardedDataParallel`` wrapper."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def fsdp_modules(model: nn.Module) -> list[Any]:
    """The modules of ``model`` that ``fully_shard`` was applied to."""
    if _FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, _FSDPModule)]


def fsdp_units(model: nn.Module) -> list[Any]:
    """FSDP2's parameter groups in ``model`` (one per ``fully_shard`` call that took parameters)."""
    return [group for m in fsdp_modules(model) for group in m._get_fsdp_state()._fsdp_param_groups]


def lazily_initialized(model: nn.Module) -> bool:
    """Whether FSDP2 has run its first forward (and read its dtypes) for ``model``."""
    return any(m._get_fsdp_state()._is_root is not None for m in fsdp_modules(model))


def process_group(model: nn.Module) -> Any:
    """The process group ``model``'s FSDP2 units shard over (flattened for 2-D meshes); ``None`` unsharded."""
    for unit in fsdp_units(model):
        for fp in unit.fsdp_params:
            mesh = fp.sharded_param.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    return None


def set_unit_precision(unit: Any, param_dtype: torch.dtype | None, where: str) -> None:
    """Gather ``unit``'s parameters in ``param_dtype`` (``None``: as stored); reduce gradients in fp32.

    A reduce dtype the user gave ``fully_shard`` is kept; a param dtype that conflicts with the
    level's raises.
    """
    current = unit.mp_policy
    if current.param_dtype is not None and param_dtype is not None and current.param_dtype is not param_dtype:
        raise ValueError(
            f"fully_shard({where}) was given mp_policy=MixedPrecisionPolicy(param_dtype={current.param_dtype}) "
            f"but the prepare level gathers parameters in {param_dtype}; leave mp_policy out of fully_shard "
            "(prepare sets it) or pass the same dtype to prepare"
        )
    reduce_dtype = current.reduce_dtype if current.reduce_dtype is not None else torch.float32
    unit.mp_policy = dataclasses.replace(current, param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def gather_kept_in_fp32(model: nn.Module, kept: set[int]) -> None:
    """O2: in each unit with low-precision parameters, gather the kept ones (ids in ``kept``) in fp32.

    The unit's shards are all fp32 (the masters); FSDP2 casts each parameter to the unit's
    ``param_dtype`` for the all-gather, and takes a parameter's own ``param_dtype`` of ``None``
    as "as stored": the kept ones are gathered in fp32 in the same all-gather (FSDP2 packs mixed
    dtypes as bytes). FSDP2 reduce-scatters a unit's gradients in one dtype, so the low-precision
    ones are widened to fp32 as backward leaves them, in the slot FSDP2 itself widens them into
    while gradient sync is off: the one reduce-scatter, in fp32 (the unit's reduce dtype anyway),
    no extra collective.
    """
    for unit in fsdp_units(model):
        params = unit.fsdp_params
        ours = [fp for fp in params if id(fp.sharded_param) in kept]
        if not ours or len(ours) == len(params):
            continue
        for fp in params:
            if id(fp.sharded_param) in kept:
                fp.init_dtype_attrs = types.MethodType(_gathered_as_stored, fp)
            else:
                fp.accumulate_unsharded_grad_if_needed = types.MethodType(_widen_gradient, fp)


def _gathered_as_stored(fsdp_param: Any, mp_policy: Any) -> None:
    type(fsdp_param).init_dtype_attrs(fsdp_param, mp_policy)
    fsdp_param.param_dtype = None


def _widen_gradient(fsdp_param: Any) -> None:
    gathered = getattr(fsdp_param, "_unsharded_param", None)
    grad = None if gathered is None else gathered.grad
    widen = grad is not None and grad.dtype is not torch.float32 and fsdp_param.unsharded_accumulated_grad is None
    if gathered is not None and widen:
        fsdp_param.unsharded_accumulated_grad = grad.to(torch.float32)  # type: ignore[union-attr]
        gathered.grad = None
        return
    type(fsdp_param).accumulate_unsharded_grad_if_needed(fsdp_param)


def split_kept_units(model: nn.Module, kept: set[int], kept_modules: Iterable[nn.Module]) -> dict[int, nn.Parameter]:
    """Move the kept modules out of each unit with low-precision parameters into one fp32 unit of their own.

    ``kept`` holds the ids of the parameters kept in fp32; ``kept_modules`` the outermost
    kept modules. Returns old parameter id -> new parameter, for the optimizer.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import unsafe_setattr_param

    where: dict[int, tuple[nn.Module, str]] = {}  # id(old shard) -> where its parameter lives
    leaving: dict[int, tuple[Any, list[nn.Module]]] = {}  # id(unit) -> its mesh, the kept modules leaving it
    owner = {id(p): m for m in kept_modules for p in m.parameters()}
    for unit in fsdp_units(model):
        ours = [fp for fp in unit.fsdp_params if id(fp.sharded_param) in kept]
        if not ours or len(ours) == len(unit.fsdp_params):
            continue  # all low precision, or all kept: one dtype already
        for fp in ours:
            info = fp._module_info
            module = owner.get(id(fp.sharded_param))
            if module is None:
                raise ValueError(
                    f"parameter {info.param_name!r} of a module kept in fp32 is shared with a module that is not kept; "
                    "keep both modules or neither"
                )
            unit.fsdp_params.remove(fp)
            # One all-gather: the whole fp32 value, sharded again by the new unit below.
            whole = nn.Parameter(
                fp.sharded_param.full_tensor().detach().clone(), requires_grad=fp.sharded_param.requires_grad
            )
            places = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names, strict=True)]
            for place, name in places:
                unsafe_setattr_param(place, name, whole)
            where[id(fp.sharded_param)] = places[0]
            mesh, modules = leaving.setdefault(id(unit), (fp.sharded_param.device_mesh, []))
            if not any(m is module for m in modules):
                modules.append(module)
    for mesh, modules in leaving.values():
        # The kept modules of one unit become one fp32 unit (a fresh unit's default dtypes): one all-gather
        # and one reduce-scatter for all of them; small, so kept gathered from forward until backward.
        fully_shard(modules, mesh=mesh, reshard_after_forward=False)
    # fully_shard replaced the whole parameters with new shards: the optimizer must hold those.
    return {old: getattr(module, name) for old, (module, name) in where.items()}
