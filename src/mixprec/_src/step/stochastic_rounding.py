"""bf16 weights updated with stochastic rounding: the optimizer steps in fp32, the weights round unbiased.

Level ``"bf16-sr"`` of :func:`mixprec.prepare` keeps weights and optimizer state in bf16 only.
The optimizer runs in fp32 on transient copies and each weight is written back rounded up with
probability equal to the discarded fraction, so updates far below half a bf16 step survive on
average instead of being rounded away. This module patches the optimizer: Adam and AdamW step
through one compiled fused kernel (``sr_kernel``), any other optimizer steps fp32 copies with its
own code; the rounding noise (``sr_noise``) is a pure function of integers kept in the
optimizer's param groups (a seed and a step counter, ``"mixprec_sr_seed"`` and
``"mixprec_sr_step"``), so ``optimizer.state_dict()`` and ``torch.distributed.checkpoint`` carry
it and a resumed run rounds exactly as an uninterrupted one. Nothing here syncs with the device.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec._src import dispatch_modes, sharding
from mixprec._src.optim import cpu_lists
from mixprec._src.step import versions
from mixprec._src.step.host_counts import HostCounts
from mixprec._src.step.sr_kernel import adam_scalars, adam_sr_update, compiled_kernel, fused_supported
from mixprec._src.step.sr_noise import refuse_capture, seed_tensor, shard_seed, sr_bits, tensor_seed

__all__ = [
    "SEED_KEY",
    "STEP_KEY",
    "Restore",
    "add_counters",
    "finisher",
    "fixed_positions",
    "install",
    "positions",
    "remove_counters",
    "step_eagerly",
]

#: param-group keys that hold the rounding noise's seed and each group's step counter
SEED_KEY = "mixprec_sr_seed"
STEP_KEY = "mixprec_sr_step"
# optimizer.__dict__ keys: positions fixed while one parameter at a time is stepped; the generic path's write-back
_POSITIONS = "_mixprec_sr_positions"
_FINISHER = "_mixprec_sr_finisher"
_EAGER = "_mixprec_eager"  # on the function step_eagerly made


class Restore:
    """A handle whose remove() drops an instance attribute that shadows the class's method."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def _advance(group: dict[str, Any]) -> tuple[int, int]:
    """Count one more step for ``group``; its seed and the new count (never inside a CUDA graph capture)."""
    refuse_capture()
    group[STEP_KEY] = int(group[STEP_KEY]) + 1
    return int(group[SEED_KEY]), int(group[STEP_KEY])


def positions(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(tensor) -> its position in the optimizer (group after group): part of its seed.

    While :func:`fixed_positions` holds (one parameter stepped at a time, in a param group of its own), the positions
    of the optimizer's real groups."""
    fixed: dict[int, int] | None = optimizer.__dict__.get(_POSITIONS)
    if fixed is not None:
        return fixed
    every = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    return dict(zip(map(id, every), itertools.count()))  # built in C: this runs at every step


class fixed_positions:  # noqa: N801 - a context manager named for what holds inside it
    """Inside it, :func:`positions` gives the positions ``optimizer`` has now, whatever its groups become
    (``known``: those positions, where the caller made them already)."""

    def __init__(self, optimizer: torch.optim.Optimizer, known: dict[int, int] | None = None) -> None:
        self.optimizer, self.known = optimizer, known

    def __enter__(self) -> None:
        self.optimizer.__dict__[_POSITIONS] = positions(self.optimizer) if self.known is None else self.known

    def __exit__(self, *_: Any) -> None:
        self.optimizer.__dict__.pop(_POSITIONS, None)


def finisher(optimizer: torch.optim.Optimizer) -> Any:
    """What the generic path runs after the optimizer's own step (a step post-hook): the fp32 copies written
    back to the bf16 weights; ``None`` where the fused kernel steps, or nothing rounds stochastically."""
    return optimizer.__dict__.get(_FINISHER)


#: ``(param, its state) -> the kernel's argument after the weight, gradient and moments``: bf16-sr's rounding seed
#: (an int), bf16-kahan's compensation (the local shard)
PerTensor = Callable[[torch.Tensor, dict[str, Any]], "int | torch.Tensor"]
#: ``extras(optimizer, group)``, called once per param group, gives its :data:`PerTensor`
Extras = Callable[[torch.optim.Optimizer, dict[str, Any]], PerTensor]


def install_fused_adam(
    optimizer: torch.optim.Optimizer,
    lowp: set[int],
    handles: list[Any],
    kernel: Callable[..., None],
    extras: Extras,
    eager: Callable[..., None],
    rounding: int,
    sharded: bool = True,
) -> None:
    """Have Adam(W)'s own ``step`` update the bf16 tensors ``lowp`` (ids) with one fused kernel (``sharded``: some
    of them are DTensors, whose local shards it steps).

    ``step`` itself is left alone (its hooks, profiling and LR schedulers' wrappers all stay in
    place): Adam's ``_init_group``, which ``step`` calls once per param group to collect the
    tensors to update, is overridden on this optimizer. It updates the bf16 weights of the group and
    hands the rest (fp32 weights of kept modules) to Adam's own. On the CPU the group's bf16 weights step
    together, one call of ``cpu_lists``'s kernel (``rounding``: its mode) per step count; elsewhere each
    takes the compiled ``kernel(weight, gradient, exp_avg, exp_avg_sq, extra, scalars)`` on 1-D views of the
    local shards, bitwise the same update. Under a Python dispatch mode (``FlopCounterMode``), where
    compiled code cannot run, ``eager`` (the kernel's uncompiled function) steps each, and the mode sees its ops.

    Whatever the form of the user's Adam(W) (``foreach``, ``fused``), the bf16 weights take this kernel, and their
    version counters move as that form's would (not with ``fused``: torch's fused kernel does not move them). A
    GradScaler that drives a fused Adam(W) (it sets ``grad_scale`` and ``found_inf`` on it and leaves
    unscaling and skipping to the optimizer) is honoured: the bf16 gradients are unscaled in place and
    ``found_inf`` is read once (a host sync: bf16 needs no loss scaling; a disabled scaler costs nothing).
    """
    adams_own = type(optimizer)._init_group  # type: ignore[attr-defined]
    multi = cpu_lists.available()
    counts = HostCounts()
    local_of = sharding.local if sharded else _itself

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)))
        ours, rest = _split(group, lowp, local_of)
        if ours and _scaled_step_skips(self, ours):
            ours = []
        more = extras(self, group)
        mode = dispatch_modes.active()
        run = eager if mode else kernel
        states = [_adam_state(self, p) for p in ours]
        lists: dict[float, list[Any]] = {}  # step count -> the CPU kernel's rows
        by_step: dict[tuple[float, torch.device], torch.Tensor] = {}
        for p, st, step in zip(ours, states, counts.advance(ours, states), strict=True):
            local = [local_of(t) for t in (p.data, p.grad, st["exp_avg"], st["exp_avg_sq"])]  # type: ignore[arg-type]
            extra = more(p, st)
            comp = extra if isinstance(extra, torch.Tensor) else None
            if multi and not mode and cpu_lists.takes(*local, *([] if comp is None else [comp])):
                lists.setdefault(step, []).append((*local, comp, 0 if comp is not None else extra))
                continue
            device = local[0].device
            scalars = by_step.get((step, device))
            if scalars is None:
                scalars = by_step[step, device] = adam_scalars(group, step, decoupled).to(device)
            flat = [t.view(-1) for t in local]  # 1-D views of the shards: one compiled graph serves every shape
            run(*flat, comp.view(-1) if comp is not None else seed_tensor(int(extra), device), scalars)
        for step, rows in lists.items():
            cpu_lists.adam_step(rows, adam_scalars(group, step, decoupled), rounding)
        versions.move_as_torch(group, ours)
        if not rest:  # Adam's own would collect nothing: no complex parameter among none
            return False
        return adams_own(self, {**group, "params": rest}, *args, **kwargs)

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    handles.append(Restore(optimizer, "_init_group"))


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """``p``'s Adam state, made at its first step (moments like ``p``, a step count on the host)."""
    st: dict[str, Any] = optimizer.state[p]
    if "step" not in st:
        st["step"] = torch.tensor(0.0)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif st["step"].device.type != "cpu":  # a fused Adam's checkpoint loaded: counted on the host from now on
        st["step"] = st["step"].cpu()
    return st


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _split(
    group: dict[str, Any], lowp: set[int], local_of: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The group's bf16 weights the kernel steps (a gradient, contiguous local shards), and the rest."""
    ours: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for p in group["params"]:
        grad = p.grad
        mine = grad is not None and id(p) in lowp and local_of(grad).is_contiguous()
        (ours if mine and local_of(p.data).is_contiguous() else rest).append(p)
    return ours, rest


def _scaled_step_skips(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Where a GradScaler left unscaling and skipping to the optimizer (a fused one): the bf16 gradients unscaled in
    place; whether this step is skipped (``found_inf`` read: a sync)."""
    grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
    if found_inf is not None and bool(found_inf):
        return True
    if grad_scale is not None:
        torch._foreach_div_([sharding.local(p.grad) for p in params if p.grad is not None], grad_scale.float())
    return False


def _seeds(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> PerTensor:
    """bf16-sr's extras: the group counts one more step; each tensor's seed from its position."""
    base, step = _advance(group)
    position = positions(optimizer)

    def seed(p: torch.Tensor, state: dict[str, Any]) -> int:
        return shard_seed(tensor_seed(base, step, position[id(p)]), p)

    return seed


def _stochastic_write(param: torch.Tensor, shadow: torch.Tensor, shadow_state: dict[str, Any], seed: int) -> None:
    """The weight update is rounded stochastically: add noise below the 16 kept bits and truncate; the copy
    into the bf16 parameter is then exact."""
    local = sharding.local(param.data)
    bits = sr_bits(sharding.local(shadow.data).reshape(-1), seed_tensor(seed, local.device))
    local.copy_(bits.view(torch.float32).view(local.shape))


#: ``write(param, shadow, shadow_state, seed)``: the bf16 ``param`` from its stepped fp32 copy ``shadow``
Write = Callable[[torch.Tensor, torch.Tensor, dict[str, Any], int], None]


#: ``compensation(state, param)``: bf16-kahan's compensation of ``param``, made at its first step
Compensation = Callable[[dict[str, Any], torch.Tensor], torch.Tensor]


def install_generic(
    optimizer: torch.optim.Optimizer,
    lowp: set[int],
    handles: list[Any],
    write: Write = _stochastic_write,
    rounding: int = cpu_lists.STOCHASTIC,
    compensation: Compensation | None = None,
) -> None:
    """Step fp32 copies of the bf16 tensors ``lowp`` (ids) with the optimizer's own code, then ``write`` them back.

    torch's SGD on the CPU steps them instead in one call a param group (``cpu_lists.sgd_step``: its for-loop's
    arithmetic on the copies, bit for bit, ``rounding`` the write: bf16-sr's noise, or Kahan's with each weight's
    ``compensation(state, param)``), with no copy made; the others (fused or differentiable SGD, under a Python
    dispatch mode, tensors the kernel does not take) as any optimizer's.
    """
    shadows: list[tuple[dict[str, Any], int, torch.Tensor, torch.Tensor, int]] = []
    listing = type(optimizer) is torch.optim.SGD and cpu_lists.sgd_available()

    def widen(opt: torch.optim.Optimizer, group: dict[str, Any]) -> set[int]:
        # The optimizer steps fp32 shadows swapped into its param groups, state moved over. The
        # parameters themselves keep their dtype: changing it through .data would reset their
        # gradient accumulators, and with them the hooks DDP all-reduces through.
        base, step = _advance(group)
        position = positions(opt)
        lists = listing and not (group.get("fused") or group.get("differentiable") or dispatch_modes.active())
        rows: list[tuple[Any, ...]] = []
        listed: set[int] = set()
        for i, param in enumerate(group["params"]):
            if id(param) not in lowp or param.grad is None:
                continue
            seed = shard_seed(tensor_seed(base, step, position[id(param)]), param)
            if lists and _sgd_row(opt, group, param, seed, rows, compensation):
                listed.add(id(param))
                continue
            shadow = param.detach().float().requires_grad_(True)
            shadow.grad = param.grad.float()
            param_state = opt.state.pop(param, {})
            opt.state[shadow] = {
                k: (v.float() if isinstance(v, torch.Tensor) and v.dtype is torch.bfloat16 and v.dim() > 0 else v)
                for k, v in param_state.items()
            }
            group["params"][i] = shadow
            shadows.append((group, i, param, shadow, seed))
        if rows:
            cpu_lists.sgd_step(rows, group, rounding)
            torch.autograd.graph.increment_version([p for p in group["params"] if id(p) in listed])  # as SGD's ops
        return listed

    def narrow(opt: torch.optim.Optimizer, *_: Any) -> None:
        with torch.no_grad():
            for group, i, param, shadow, seed in shadows:
                write(param, shadow, opt.state[shadow], seed)
                # Optimizer state goes back to bf16 rounded to nearest: it is not accumulated in
                # tiny increments the way weights are.
                shadow_state = opt.state.pop(shadow, {})
                opt.state[param] = {
                    k: (
                        v.to(torch.bfloat16)
                        if isinstance(v, torch.Tensor) and v.dtype is torch.float32 and v.dim() > 0
                        else v
                    )
                    for k, v in shadow_state.items()
                }
                group["params"][i] = param
        shadows.clear()

    own_init_group = getattr(type(optimizer), "_init_group", None)
    if own_init_group is not None and type(optimizer).__module__.startswith("torch.optim."):
        # Every torch.optim optimizer but LBFGS and SparseAdam collects each group's tensors with
        # _init_group, once per group, inside step: widening there, rather than in a step pre-hook,
        # runs after the user's pre-hooks (they see and may change the bf16 gradients, or raise and
        # leave the optimizer as it was). Other classes may not call it from step: a pre-hook.
        def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            listed = widen(self, group)
            if listed:  # stepped already: torch's step collects the rest
                group = {**group, "params": [p for p in group["params"] if id(p) not in listed]}
            return own_init_group(self, group, *args, **kwargs)

        optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
        handles.append(Restore(optimizer, "_init_group"))
    else:

        def widen_all(opt: torch.optim.Optimizer, *_: Any) -> None:
            for group in opt.param_groups:
                widen(opt, group)

        handles.append(optimizer.register_step_pre_hook(widen_all))
    handles.append(optimizer.register_step_post_hook(narrow))
    optimizer.__dict__[_FINISHER] = narrow
    handles.append(Restore(optimizer, _FINISHER))


def _sgd_row(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    param: torch.Tensor,
    seed: int,
    rows: list[tuple[Any, ...]],
    compensation: Compensation | None,
) -> bool:
    """``param``'s row of ``cpu_lists.sgd_step`` added to ``rows`` (its momentum buffer made where it has none), or
    ``False`` where the kernel does not take its tensors."""
    state = optimizer.state[param]
    local_p, local_g = sharding.local(param.data), sharding.local(param.grad)  # type: ignore[arg-type]
    buffer = state.get("momentum_buffer")
    comp = None if compensation is None else sharding.local(compensation(state, param))
    held = [t for t in (None if buffer is None else sharding.local(buffer), comp) if t is not None]
    if not cpu_lists.takes(local_p, local_g, *held):
        return False
    started = buffer is not None
    if not started and float(group["momentum"]) != 0:  # torch's first step makes it from the gradient
        buffer = state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    rows.append((local_p, local_g, None if buffer is None else sharding.local(buffer), comp, seed, started))
    return True


def add_counters(optimizer: torch.optim.Optimizer, seed: int, handles: list[Any]) -> None:
    """Put the rounding seed and step counters into every param group of ``optimizer``.

    Every prepared optimizer carries them, at every level (``seed`` 0 where nothing rounds
    stochastically), so a checkpoint of one level has the keys another level's
    ``torch.distributed.checkpoint`` load asks for. A state dict saved without them (a plain
    optimizer's) leaves this run's in place.
    """
    for group in optimizer.param_groups:
        group.setdefault(SEED_KEY, seed)
        group.setdefault(STEP_KEY, 0)
    kept: list[dict[str, int]] = []

    def keep_counters(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        kept[:] = [{SEED_KEY: g[SEED_KEY], STEP_KEY: g[STEP_KEY]} for g in opt.param_groups]

    def restore_missing(opt: torch.optim.Optimizer) -> None:
        for group, before in zip(opt.param_groups, kept, strict=False):
            for key, value in before.items():
                group.setdefault(key, value)
        kept.clear()

    handles.append(optimizer.register_load_state_dict_pre_hook(keep_counters))  # type: ignore[arg-type]
    handles.append(optimizer.register_load_state_dict_post_hook(restore_missing))


def install(optimizer: torch.optim.Optimizer, lowp: Iterable[torch.Tensor], handles: list[Any]) -> bool:
    """Make ``optimizer`` write the bf16 tensors ``lowp`` back with stochastic rounding.

    The noise comes from the counters :func:`add_counters` put in the param groups. Returns
    whether Adam(W)'s fused kernel is in use.
    """
    lowp = list(lowp)
    ids = {id(p) for p in lowp}
    step_eagerly(optimizer, handles)
    kernel = compiled_kernel() if fused_supported(optimizer) else None
    if kernel is not None:
        install_fused_adam(
            optimizer,
            ids,
            handles,
            kernel,
            _seeds,
            adam_sr_update,
            cpu_lists.STOCHASTIC,
            any(sharding.is_sharded(p) for p in lowp),
        )
        return True
    install_generic(optimizer, ids, handles)
    return False


def step_eagerly(optimizer: torch.optim.Optimizer, handles: list[Any]) -> None:
    """In a compiled training step, this optimizer's ``step`` runs eagerly (one graph break around it).

    The rounding counts steps in Python and swaps or updates tensors inside ``_init_group``, which
    Dynamo runs once, at trace time, when it compiles an optimizer's step: compiled, every later step
    would skip the update. Eagerly, Adam(W)'s fused kernel is compiled on its own. The step stays a
    bound method (LR schedulers wrap ``step.__func__``); one a scheduler already wrapped stays wrapped.
    """
    own = optimizer.__dict__.get("step")
    func = type(optimizer).step if own is None else getattr(own, "__func__", None)
    if getattr(func, _EAGER, False):  # made eager already (bf16-sr's and quantized state's installs both ask)
        return
    if func is None:  # a plain callable set by hand
        eager = torch._dynamo.disable(own)  # type: ignore[no-untyped-call]
    else:
        disabled = torch._dynamo.disable(func)  # type: ignore[no-untyped-call]
        setattr(disabled, _EAGER, True)
        eager = types.MethodType(disabled, optimizer)
    optimizer.step = eager  # type: ignore[method-assign]
    handles.append(_PutBack(optimizer, "step", own))


class _PutBack:
    """A handle whose remove() puts an instance attribute back as it was (or drops it)."""

    def __init__(self, obj: object, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value

    def remove(self) -> None:
        if self.value is None:
            self.obj.__dict__.pop(self.name, None)
        else:
            self.obj.__dict__[self.name] = self.value


def remove_counters(optimizer: torch.optim.Optimizer) -> None:
    """Drop the rounding counters from ``optimizer``'s param groups (undoing :func:`install`)."""
    for group in optimizer.param_groups:
        group.pop(SEED_KEY, None)
        group.pop(STEP_KEY, None)
