"""Precision levels for a model and its optimizer: O1, O2 master weights, pure bf16 with stochastic rounding.

``model, optimizer = mixprec.prepare(model, optimizer, level=..., dtype=...)``:

* ``"O1"``: autocast only; the model's forward runs under :func:`mixprec.autocast`.
* ``"O2"``: the parameters stay fp32 and are the master weights the optimizer steps; the
  forward of each module computes with a low-precision copy of its parameters, made once
  after every optimizer step (or write into a weight), not once per forward. Buffers are
  stored in ``dtype``. Gradients flow into the fp32 parameters, summed in fp32. State
  dicts, clipping, ``torch.distributed.checkpoint`` and DDP see fp32 parameters.
* ``"bf16-sr"``: weights and optimizer state in bf16 only, no master copy; the optimizer
  steps in fp32 and writes the weights back with stochastic rounding
  (``stochastic_rounding.py``), seeded from the optimizer's param groups, so a
  checkpoint resumes bit for bit.
* ``"bf16-kahan"``: bf16 weights and state, the updates written with a bf16 Kahan compensation
  per weight (``kahan.py``, optimi's method): what rounding drops is carried to the next step.
* ``"bf16-pure"``: bf16 weights and state with round-to-nearest updates; the baseline that
  shows what stochastic rounding and compensation fix.

Modules kept in fp32 (norm layers by default, or by name) are stored in fp32 and compute in
fp32 at every level: their own hooks turn autocast off and cast their floating inputs to fp32,
so activation checkpointing replays them with no extra argument. At every level the model's
forward runs under :func:`mixprec.autocast` (ops on the lists still run in fp32 where they
should) and floating outputs are returned as fp32, in the output's own container type.

Under FSDP2 (``fully_shard``), prepare after sharding and after building the optimizer: each
level becomes FSDP2's own mixed precision (see ``sharding.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec._src import bound_forward, casting, input_checks, sharding
from mixprec._src.amp.autocast import autocast
from mixprec._src.dtypes import short_name
from mixprec._src.fp8 import all_gather as fp8_all_gather
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8.linear import Fp8Scaling
from mixprec._src.gemms import fused_paths
from mixprec._src.policy.rules import default_policy
from mixprec._src.prepare import checks, kept, o2_copies
from mixprec._src.prepare.config import Level, PrepareConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mixprec._src.prepare.config import PrepareOptions
from mixprec._src.step import kahan, state_checks, state_dicts, stochastic_rounding
from mixprec._src.step import plan as step_plan
from mixprec._src.step import step_in_backward as in_backward

__all__ = ["export_fp32", "master_params", "prepare", "Prepared", "prepared_state"]

_ATTR = "_mixprec"  # where prepare keeps its state, on the model and on the optimizer
#: how each level writes its low-precision weights (the others: to nearest)
_WRITES = {Level.BF16_SR: "stochastic", Level.BF16_KAHAN: "kahan"}


@dataclasses.dataclass
class Prepared:
    """What prepare set up for a model and its optimizer; kept on both."""

    config: PrepareConfig
    device_type: str
    original_forward: Callable[..., Any]
    handles: list[Any]
    lowp_params: list[nn.Parameter]  # stored in dtype (bf16 levels) or computed from a copy in dtype (O2)
    kept_modules: list[nn.Module]  # outermost modules kept in fp32
    buffers: list[tuple[nn.Module, str]]  # buffers prepare stored in dtype
    copies: o2_copies.ComputeCopies | None = None  # O2, parameters FSDP2 does not manage
    sharded: bool = False  # FSDP2 units were set up for the level
    checked: bool = False  # the first forward looked for FSDP2 units added since
    told_outer: bool = False  # a forward inside an autocast region of another dtype was told of, once
    fused: bool = False  # bf16-sr: Adam(W) steps the bf16 weights with the compiled fused kernel
    step: step_plan.StepPlan | None = None  # what the optimizer's step does (None: a pickle of an older version)
    on_modules: list[Any] = dataclasses.field(default_factory=list)  # the handles of hooks on the model's modules
    own_call: Callable[..., Any] | None = None  # O2: the call that swaps the root model's own parameters

    @property
    def level(self) -> Level:
        return self.config.level

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def output_dtype(self) -> torch.dtype | None:
        return self.config.output_dtype

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its model (``torch.save(model)``): the hooks on the model's modules come along, so the
        loaded model computes as this one; those on the optimizer do not (torch pickles an optimizer without
        its hooks), so the loaded model is not tied to one: ``export_fp32`` it, then ``prepare`` it again with
        an optimizer to train it."""
        return {**self.__dict__, "handles": list(self.on_modules)}


def prepared_state(obj: nn.Module | torch.optim.Optimizer) -> Prepared | None:
    """What :func:`prepare` set up for this model or optimizer, or ``None`` if it was not prepared."""
    state: Prepared | None = obj.__dict__.get(_ATTR)
    return state


def master_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates: at every level, the model's parameters (fp32 at O2)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    level: Level | str | PrepareConfig = Level.O2,
    dtype: torch.dtype | str | None = None,
    **options: Unpack[PrepareOptions],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Put ``model`` and ``optimizer`` at a precision level; returns them (changed in place).

    ``prepare(model, optimizer, "O2", keep_names="head")`` and
    ``prepare(model, optimizer, PrepareConfig(level="O2", keep_names=("head",)))`` are the same.

    Under FSDP2, call it after ``fully_shard`` and after building the optimizer, before the first
    forward; it is then collective (every rank calls it). Under DDP, call it before wrapping.

    Args:
        model: an fp32 model, already on its device (and sharded, with FSDP2).
        optimizer: any ``torch.optim`` optimizer over the model's parameters, created after the
            model was moved (and sharded).
        level: ``"O1"``, ``"O2"``, ``"bf16-sr"``, ``"bf16-kahan"`` or ``"bf16-pure"``, or a whole
            :class:`PrepareConfig` (then give no other option).
        dtype: the low precision (bf16 or fp16; the bf16 levels need bf16); bf16 where not given.
        options: :class:`PrepareConfig`'s other fields, by keyword:

        keep_types, keep_names: modules kept in fp32, by type or qualified-name glob.
        keep_filter: ``(module, qualified_name) -> bool``; modules it accepts are kept in fp32 too.
        output_dtype: floating outputs of the model's forward are cast to this (``None``: as computed).
        policy: the autocast policy of the prepared forward (default: the device's built-in lists).
        fp8: linears computed in fp8: a recipe (``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"``, ``"delayed"``) or an :class:`Fp8Config` choosing layers and
            scaling; ``mixprec.fp8_layers(model)`` lists the layers converted and those left out.
        optimizer_state: Adam's and AdamW's moments and SGD's momentum as the level keeps them (``"fp32"``), in
            bf16 with stochastic rounding (``"bf16"``), or block-wise quantized (``"8bit"``, ``"4bit"``, ``"fp8"``:
            torchao's formats) for parameters of 4096 values or more; ``optimizer.state_dict()`` holds the bf16
            moments, or the codes and scales.
        step_in_backward: step each parameter in backward as soon as its gradient is whole and free the gradient
            (``optimizer.step()`` then finishes the step: the small parameters, biases and norms, stepped together;
            hooks, counters); no accumulation over backwards, no fp16.
        clip_grad_norm: clip gradients to this global norm before each step (in backward: by the previous
            step's norm, or this backward's so far where larger); :func:`mixprec.grad_norm` gives the norm.

    Raises:
        ValueError: a model not in fp32, an optimizer holding tensors that are not this model's
            parameters or holding one twice, a prepared model, a model wrapped in DDP or the older
            FSDP, a sharded model that already ran a forward, a bad level or dtype.
        TypeError: a PrepareConfig together with other options, an unknown option, an option of the wrong type.
    """
    if isinstance(level, PrepareConfig):
        if dtype is not None or options:
            raise TypeError(
                "prepare takes a PrepareConfig or options, not both; put the options in the config "
                "(dataclasses.replace(config, ...))"
            )
        config = level
    else:
        config = PrepareConfig.of(level, **({"dtype": dtype} if dtype is not None else {}), **options)
    level, dtype = config.level, config.dtype
    if level in (Level.O2, Level.BF16_SR, Level.BF16_KAHAN) and isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            f"LBFGS re-evaluates the model inside step(), and level {level.value!r} updates the low-precision "
            "weights only after step(); use level 'O1' or 'bf16-pure' with LBFGS"
        )
    checks.check_wrapping(model)
    if prepared_state(model) is not None:
        raise ValueError("this model was already prepared; call mixprec.export_fp32(model) first to prepare it anew")
    sharded = bool(sharding.fsdp_modules(model))
    if sharded and sharding.lazily_initialized(model):
        raise ValueError(
            "this fully_shard model already ran a forward, where FSDP2 fixes the dtypes it gathers and reduces "
            "in; call mixprec.prepare(model, optimizer, ...) after fully_shard and building the optimizer, before "
            "the first forward"
        )
    checks.check_model_and_optimizer(model, optimizer, sharded)
    state_checks.check(optimizer, config.optimizer_state)
    if config.step_in_backward:
        in_backward.check(optimizer)
    if config.fp8 is not None:  # before anything is installed: a refusal leaves the model as it was
        fp8_conversion.check_device(model, config.fp8)
        if config.fp8.all_gather and not sharded:
            raise ValueError(
                "Fp8Config(all_gather=True) sets FSDP2's all-gather of the fp8 weights; this model has no "
                "fully_shard units: shard it first, or leave all_gather off"
            )
    device_type = input_checks.device_type_of(model)
    kept_modules = kept.outermost(model, config)
    state = Prepared(config, device_type, model.forward, [], [], kept_modules, [], sharded=sharded)
    # Registered first, so it runs before any other step hook (bf16-sr's, the user's).
    check = functools.partial(checks.check_still_ours, model, state, checks.Fingerprint())
    state.handles.append(optimizer.register_step_pre_hook(check))
    policy = config.policy if config.policy is not None else default_policy(device_type)
    kept.keep_in_fp32(kept_modules, device_type, state.handles, policy)
    fused_paths.keep_layers_called(model)  # a kept norm with a forward of its own is still called in evaluation
    layers = None
    if config.fp8 is not None:
        inside_kept = {id(m) for k in kept_modules for m in k.modules()}
        outermost = {id(k) for k in kept_modules}
        named = [(n, type(m).__name__) for n, m in model.named_modules() if id(m) in outermost]
        layers = fp8_conversion.convert(model, config.fp8, inside_kept, named)
        group = sharding.process_group(model) if sharded else None
        state.handles.append(optimizer.register_step_post_hook(lambda *_: fp8_conversion.advance(layers, group)))
    # Every prepared model loads checkpoints of the same model under another fp8 recipe, or none.
    state.handles.append(model.register_load_state_dict_pre_hook(fp8_conversion.drop_foreign_fp8_state))  # type: ignore[no-untyped-call]

    if level is not Level.O1:
        _lower(model, optimizer, state)
        fused_paths.keep_layers_called(model)  # O2's layers with a call of their own, too
    if layers is not None and layers.config.all_gather:  # on the shards as _lower left them
        fp8_all_gather.install(model, layers)
    # The optimizer's step, planned once from the config and installed in one place (step/plan.py).
    state.step = step_plan.StepPlan.of(
        optimizer,
        write=_WRITES.get(level, "nearest"),
        state=config.optimizer_state,
        in_backward=config.step_in_backward,
        clip=config.clip_grad_norm,
        bf16_weights=level.bf16_weights,
    )
    state.fused = step_plan.install(
        state.step,
        model,
        optimizer,
        state.lowp_params,
        state.handles,
        group=sharding.process_group(model) if sharded else None,
        slices=level is not Level.O2,
        copies=state.copies,
    )

    # Bound to the model (a deep copy rebinds them to the copy). _call_impl runs before every
    # module hook, FSDP2's included: the place to refuse a model sharded after prepare.
    bound_forward.bind(model, _prepared_forward)
    if not sharded:  # O2's copies of the model's own parameters go in place inside this call
        state.own_call = model.__dict__.get("_call_impl")
        model._call_impl = bound_forward.BoundForward(_prepared_call, model)  # type: ignore[method-assign]
    # the handles a pickled model keeps (Prepared.__getstate__): those of the hooks on its own modules
    hook_dicts = {id(d) for m in model.modules() for d in vars(m).values() if isinstance(d, dict)}
    state.on_modules = [
        h
        for h in state.handles
        if (isinstance(h, RemovableHandle) and id(h.hooks_dict_ref()) in hook_dicts)
        or isinstance(h, kept.OwnForward | o2_copies.SwapCall)
    ]
    model.__dict__[_ATTR] = optimizer.__dict__[_ATTR] = state
    state.handles.append(checks.NoCopy(optimizer))  # a copy would step without the stages: refused, with what to do
    return model, optimizer


def _lower(model: nn.Module, optimizer: torch.optim.Optimizer, state: Prepared) -> None:
    """Put the parameters and buffers of the modules not kept in fp32 at the level's precision."""
    level, dtype, kept_modules = state.level, state.dtype, state.kept_modules
    if state.sharded and level is Level.O2:  # every shard stays fp32: the kept ones are gathered in fp32
        sharding.gather_kept_in_fp32(model, kept.param_ids(kept_modules))
    elif state.sharded:  # bf16 shards: a unit stores one dtype, so the kept modules move to fp32 units
        _replace_in_optimizer(optimizer, sharding.split_kept_units(model, kept.param_ids(kept_modules), kept_modules))
    kept_ids = kept.param_ids(kept_modules)
    inside_kept = {id(m) for k in kept_modules for m in k.modules()}
    converted = [m for m in model.modules() if id(m) not in inside_kept]
    seen: set[int] = set()  # shared parameters are converted once
    for module in converted:
        for param in module.parameters(recurse=False):
            if id(param) not in kept_ids and id(param) not in seen and param.is_floating_point():
                seen.add(id(param))
                state.lowp_params.append(param)
    in_units: set[int] = set()
    for unit in sharding.fsdp_units(model):
        params = [fp.sharded_param for fp in unit.fsdp_params]
        in_units.update(id(p) for p in params)
        if any(id(p) in seen for p in params):
            sharding.set_unit_precision(unit, dtype if level is Level.O2 else None, unit._module_fqn or "model")
    if level is Level.O2:  # FSDP2 gathers its units' low-precision weights; copies for the rest
        unmanaged = [p for p in state.lowp_params if id(p) not in in_units]
        if unmanaged:
            copies = state.copies = o2_copies.ComputeCopies(dtype, unmanaged)
            o2_copies.install_copies(converted, copies, state.handles)
            state.handles.append(optimizer.register_step_post_hook(lambda *_: copies.stale()))
    else:
        for param in state.lowp_params:
            _convert(param, dtype)
    for module in converted:
        for name, buffer in module.named_buffers(recurse=False):
            if isinstance(module, Fp8Scaling):  # amax histories stay fp32
                continue
            if buffer is not None and buffer.is_floating_point() and buffer.dtype is not dtype:
                module._buffers[name] = buffer.to(dtype)
                state.buffers.append((module, name))


def export_fp32(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    """Undo :func:`prepare`: fp32 parameters and buffers, the original forward.

    With ``optimizer``, its state is kept (in fp32), so training can go on in fp32.
    """
    state = prepared_state(model)
    if state is None:
        raise ValueError("this model was not prepared by mixprec.prepare")
    for handle in state.handles:
        handle.remove()
    with torch.no_grad():
        if state.level is Level.BF16_KAHAN and optimizer is not None:  # what rounding dropped goes into the weight
            for param in state.lowp_params:
                comp = optimizer.state.get(param, {}).pop(kahan.COMP_KEY, None)
                if comp is not None:
                    _convert(param, torch.float32)
                    param.add_(comp.float())
        if state.level.bf16_weights:
            for param in state.lowp_params:
                grad = None if param.grad is None else param.grad.float()
                param.grad = None
                _convert(param, torch.float32)
                param.grad = grad
        for module, name in state.buffers:
            buffer = module._buffers.get(name)
            if buffer is not None:
                module._buffers[name] = buffer.float()
    if optimizer is not None:
        for group_state in optimizer.state.values():
            for key, value in group_state.items():
                if isinstance(value, torch.Tensor) and value.dtype is torch.bfloat16 and key != "step":
                    group_state[key] = value.float()
        stochastic_rounding.remove_counters(optimizer)
        state_dicts.restore_fp32(optimizer)
        optimizer.__dict__.pop(_ATTR, None)
    fp8_conversion.revert(model)
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_call_impl", None)
    del model.__dict__[_ATTR]
    return model


def _prepared_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A prepared model's forward: the original under the level's autocast region, outputs cast."""
    state = model.__dict__[_ATTR]
    if not torch.compiler.is_compiling():
        if not state.checked:  # compiled: the optimizer's step checks it
            state.checked = True
            checks.check_not_sharded_since(model, state)
        if not state.told_outer:
            _tell_outer_autocast(state)
    policy = state.config.policy if state.config.policy is not None else default_policy(state.device_type)
    with autocast(state.device_type, dtype=state.dtype, policy=policy):
        out = state.original_forward(*args, **kwargs)
    return out if state.output_dtype is None else casting.cast_floating(out, state.output_dtype)


def _tell_outer_autocast(state: Prepared) -> None:
    """Warn, once per model, where the forward runs inside an autocast region of another dtype."""
    device_type = state.device_type
    if not torch.is_autocast_enabled(device_type) or torch.get_autocast_dtype(device_type) is state.dtype:
        return
    state.told_outer = True
    outer, mine = short_name(torch.get_autocast_dtype(device_type)), short_name(state.dtype)
    warnings.warn(
        f"this model was prepared to compute in {mine} and runs inside an autocast region of {outer}: it computes "
        f"in {mine}, as prepared (its precision is its own; the outer region applies around it). To compute in "
        f"{outer}, prepare it with dtype={outer!r}; otherwise leave the outer autocast out (said once per model)",
        UserWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside mixprec and torch.nn (the user's ``model(x)``)."""
    frame: types.FrameType | None = sys._getframe(2)  # the caller of warnings.warn's caller
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_CALLER):
        frame, level = frame.f_back, level + 1
    return level


_NOT_THE_CALLER = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(nn.__file__))


def _prepared_call(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = prepared_state(model)
    if state is not None and not state.sharded and sharding.is_fsdp_module(model):
        checks.check_not_sharded_since(model, state)
    own = None if state is None else state.own_call
    copies = None if state is None else state.copies
    # every torch layer's copies at once (with gradients), not one call a layer; compiled, cast in the graph
    whole = (
        copies is not None
        and bool(copies.calls)
        and torch.is_grad_enabled()
        and o2_copies.enter_whole(copies, torch.compiler.is_compiling())
    )
    try:
        if own is not None:
            return own(*args, **kwargs)
        return type(model)._call_impl(model, *args, **kwargs)  # type: ignore[no-untyped-call]
    finally:
        if whole:
            o2_copies.leave_whole(copies)  # type: ignore[arg-type]


def _convert(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Store ``param`` in ``dtype``, the same object (the optimizer and hooks keep holding it)."""
    if sharding.is_sharded(param):
        # A DTensor keeps its dtype in its metadata, which a .data swap would leave stale.
        converted = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, converted)  # type: ignore[no-untyped-call]
    else:
        param.data = param.data.to(dtype)


# ----- optimizer and outputs ----------------------------------------------------------------


def _replace_in_optimizer(optimizer: torch.optim.Optimizer, swap: dict[int, Any]) -> None:
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            new = swap.get(id(p))
            if new is not None:
                group["params"][i] = new
                if p in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(p)
