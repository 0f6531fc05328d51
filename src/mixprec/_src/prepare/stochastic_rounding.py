"""bf16 weights updated with stochastic rounding: the optimizer steps in fp32, the weights round unbiased.

Level ``"bf16-sr"`` of :func:`mixprec.prepare` keeps weights and optimizer state in bf16 only.
The optimizer runs in fp32 on transient copies and each weight is written back rounded up with
probability equal to the discarded fraction, so updates far below half a bf16 step survive on
average instead of being rounded away. Adam and AdamW step through one compiled fused kernel
(each tensor read and written once); any other optimizer steps fp32 copies with its own code.

The rounding noise is a pure function of integers kept in the optimizer's param groups (a
seed and a step counter, ``"mixprec_sr_seed"`` and ``"mixprec_sr_step"``), of the tensor's
position in the optimizer and of each element's index in the *whole* tensor. So
``optimizer.state_dict()`` and ``torch.distributed.checkpoint`` carry it (a resumed run rounds
exactly as an uninterrupted one), and a weight sharded by FSDP2 rounds as it would in one
process, whatever the world size. Nothing here syncs with the device.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from mixprec._src import sharding

__all__ = ["SEED_KEY", "STEP_KEY", "add_counters", "draw_seed", "install", "stochastic_round"]

#: param-group keys that hold the rounding noise's seed and each group's step counter
SEED_KEY = "mixprec_sr_seed"
STEP_KEY = "mixprec_sr_step"


def stochastic_round(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up with probability equal to the discarded fraction (unbiased).

    ``noise`` holds uniform random integers in [0, 2**16) (int32, ``x``'s shape or broadcastable);
    drawn with torch's generator when not given.

    Example:
        >>> import torch, mixprec
        >>> x = torch.full((100_000,), 1.0 + 2**-10)          # between two bf16 values
        >>> y = mixprec.stochastic_round(x).float()
        >>> sorted(y.unique().tolist())
        [1.0, 1.0078125]
        >>> abs(y.mean().item() - (1.0 + 2**-10)) < 2e-4     # on average, the fp32 value
        True
    """
    if x.dtype is not torch.float32:
        raise TypeError(f"stochastic_round takes an fp32 tensor, got {x.dtype}")
    if noise is None:
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    bits = x.contiguous().view(torch.int32)
    # Adding the noise below the kept 16 bits carries into them with probability equal to the
    # discarded fraction; masking then truncates. On the magnitude bits, so negatives round alike.
    rounded = (bits + noise) & -(1 << 16)
    finite = torch.isfinite(x)
    return torch.where(finite, rounded.view(torch.float32), x).to(torch.bfloat16)


# ----- the noise --------------------------------------------------------------------------

# Noise for stochastic rounding: a Weyl sequence, element i of a tensor gets the high 16 bits of
# (i * 0x9E3779B1 + seed) mod 2**32. With the seed uniform and fresh for every tensor and step, each
# element's noise is uniform on [0, 2**16) and independent from step to step, so the rounding is
# unbiased; neighbouring elements get evenly spread, not independent, noise (a dither). Computed
# in place from the index: no buffer to read and no generator call per element (torch's CPU
# generator makes about 200 M integers a second, slower than the optimizer step itself).
_WEYL = -1640531535  # 0x9E3779B1 (2**32 / golden ratio) as an int32
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


def _int32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def tensor_seed(base: int, step: int, index: int) -> int:
    """The 32-bit seed of the tensor at ``index`` in the optimizer, at the group's ``step``.

    splitmix64's finaliser over the three integers: independent-looking, uniform values for
    every (step, index), computed on the host (Python ints never wrap).
    """
    z = (base + step * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _int32((z ^ (z >> 31)) >> 32)


def shard_seed(seed: int, tensor: torch.Tensor) -> int:
    """``seed`` moved along the Weyl sequence to where ``tensor``'s local shard starts.

    Element ``i`` of the shard is element ``offset + i`` of the whole tensor, and
    ``(offset + i) * W + seed == i * W + (seed + offset * W)``: the shard rounds its elements as
    the whole tensor would. Shards that are not one run of the whole (other placements) start
    from the seed mixed with their offsets, which keeps the rounding unbiased.
    """
    where = sharding.flat_offset(tensor)
    if where is None:
        return seed
    offset, contiguous = where
    if not contiguous:  # not one run of the whole tensor: a distinct seed per shard
        return tensor_seed(seed, 0, offset + 1)
    return _int32(seed + offset * _WEYL)


def _seed_tensor(seed: int, device: torch.device) -> torch.Tensor:
    """``seed`` as an int32 scalar on ``device`` (a host-to-device copy, no sync)."""
    value = torch.tensor(seed, dtype=torch.int32)
    return value if device.type == "cpu" else value.to(device, non_blocking=True)


def sr_bits(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (1-D) stochastically rounded to bf16 precision, as fp32 bits with 16 low zeros."""
    index = torch.arange(x.numel(), dtype=torch.int32, device=x.device)
    noise = ((index * _WEYL + seed) >> 16) & 0xFFFF
    return (x.view(torch.int32) + noise) & -(1 << 16)


def draw_seed(group: Any = None) -> int:
    """A seed from torch's CPU generator (``torch.manual_seed`` repeats it).

    With ``group`` (the process group of a sharded model) every rank takes rank 0's, one
    broadcast: shards then round as one process would. Replicas (DDP) that must stay bitwise
    equal need every rank's generator seeded alike before :func:`mixprec.prepare`, as DDP
    training scripts do.
    """
    seed = int(torch.randint(0, 1 << 62, ()))
    if group is not None and dist.get_world_size(group) > 1:
        box: list[Any] = [seed]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        seed = int(box[0])
    return seed


# ----- Adam(W) as one fused, compiled update -------------------------------------------------


def adam_sr_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, seed: torch.Tensor,
                   scalars: torch.Tensor) -> None:  # fmt: skip
    """One Adam/AdamW step on 1-D bf16 tensors in fp32 math, weights written back with stochastic rounding.

    The same update as torch.optim.Adam/AdamW (amsgrad, maximize off). ``scalars`` holds, per step:
    decay (AdamW's ``1 - lr * weight_decay``, else 1), l2 (Adam's ``weight_decay``, else 0),
    beta1, ``1 - beta1``, beta2, ``1 - beta2``, ``lr / (1 - beta1**step)``, ``1 / sqrt(1 - beta2**step)``
    and eps. Compiled into one fused loop, so each tensor is read and written once.
    """
    decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps = scalars.unbind()
    p32, g32 = p.float(), g.float()
    g32 = g32 + l2 * p32
    p32 = p32 * decay
    # torch's lerp(g, 1 - beta1), written out: inductor's lerp with a scalar from a tensor ran 3x slower
    m32 = m.float() * beta1 + g32 * one_minus_beta1
    v32 = v.float() * beta2 + one_minus_beta2 * g32 * g32
    p32 = p32 - step_size * m32 / (v32.sqrt() * inv_bc2_sqrt + eps)
    p.copy_(sr_bits(p32, seed).view(torch.float32))
    m.copy_(m32)
    v.copy_(v32)


def adam_scalars(group: dict[str, Any], step: float, decoupled: bool) -> torch.Tensor:
    """The per-step scalars of :func:`adam_sr_update` for one param group."""
    lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decay, l2 = (1.0 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
    step_size = lr / (1.0 - beta1**step)
    inv_bc2_sqrt = 1.0 / (1.0 - beta2**step) ** 0.5
    return torch.tensor([decay, l2, beta1, 1.0 - beta1, beta2, 1.0 - beta2, step_size, inv_bc2_sqrt, eps])


_compiled_adam_sr: Callable[..., None] | None = None
_PROBE_GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _fused_supported(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(not g.get("amsgrad") and not g.get("maximize") and not g.get("capturable")
               and not g.get("differentiable") and not g.get("fused") for g in optimizer.param_groups)  # fmt: skip


def _compiled_kernel() -> Callable[..., None] | None:
    global _compiled_adam_sr
    if _compiled_adam_sr is None:
        try:
            compiled = cast(Callable[..., None], torch.compile(adam_sr_update, fullgraph=True, dynamic=True))
            # The probe compiles the one graph every parameter uses: under no_grad as step() calls it
            # (grad mode is among the guards), and large, because inductor picks threads and loop
            # shapes from the first sizes it sees (a tiny probe gave a single-threaded kernel).
            probe = [torch.zeros(1 << 20, dtype=torch.bfloat16) for _ in range(4)]
            with torch.no_grad():
                compiled(*probe, torch.zeros((), dtype=torch.int32), adam_scalars(_PROBE_GROUP, 1.0, True))
            _compiled_adam_sr = compiled
        except Exception:  # no C++ toolchain, an unsupported platform: keep the generic path
            return None
    return _compiled_adam_sr


class Restore:
    """A handle whose remove() drops an instance attribute that shadows the class's method."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def _advance(group: dict[str, Any]) -> tuple[int, int]:
    """Count one more step for ``group``; its seed and the new count."""
    group[STEP_KEY] = int(group[STEP_KEY]) + 1
    return int(group[SEED_KEY]), int(group[STEP_KEY])


def _positions(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(tensor) -> its position in the optimizer (group after group): part of its seed."""
    return {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def _install_fused(optimizer: torch.optim.Optimizer, lowp: set[int], handles: list[Any]) -> bool:
    """Have Adam(W)'s own ``step`` update the bf16 weights with the compiled fused kernel, if it compiles.

    ``step`` itself is left alone (its hooks, profiling and LR schedulers' wrappers all stay in
    place): Adam's ``_init_group``, which ``step`` calls once per param group to collect the
    tensors to update, is overridden on this optimizer. It updates the bf16 weights of the group
    with the fused kernel and hands the rest (fp32 weights of kept modules) to Adam's own.
    """
    kernel = _compiled_kernel()
    if kernel is None:
        return False
    adams_own = type(optimizer)._init_group  # type: ignore[attr-defined]

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)))
        by_step: dict[tuple[float, torch.device], torch.Tensor] = {}
        base, step = _advance(group)
        position = _positions(self)
        rest = []
        for p in group["params"]:
            local_p, local_g = sharding.local(p.data), None if p.grad is None else sharding.local(p.grad)
            if id(p) not in lowp or local_g is None or not (local_p.is_contiguous() and local_g.is_contiguous()):
                rest.append(p)
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            key = (float(st["step"]), local_p.device)  # the step count lives on the CPU: no sync
            scalars = by_step.get(key)
            if scalars is None:
                scalars = by_step[key] = adam_scalars(group, key[0], decoupled).to(local_p.device)
            seed = shard_seed(tensor_seed(base, step, position[id(p)]), p)
            # 1-D views of the local shards: one compiled graph serves every parameter, whatever its shape.
            flat = [sharding.local(t).view(-1) for t in (p.data, p.grad, st["exp_avg"], st["exp_avg_sq"])]
            kernel(*flat, _seed_tensor(seed, local_p.device), scalars)
        return adams_own(self, {**group, "params": rest}, *args, **kwargs)

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    handles.append(Restore(optimizer, "_init_group"))
    return True


def _install_generic(optimizer: torch.optim.Optimizer, lowp: set[int], handles: list[Any]) -> None:
    shadows: list[tuple[dict[str, Any], int, torch.Tensor, torch.Tensor, int]] = []

    def widen(opt: torch.optim.Optimizer, group: dict[str, Any]) -> None:
        # The optimizer steps fp32 shadows swapped into its param groups, state moved over. The
        # parameters themselves keep their dtype: changing it through .data would reset their
        # gradient accumulators, and with them the hooks DDP all-reduces through.
        base, step = _advance(group)
        position = _positions(opt)
        for i, param in enumerate(group["params"]):
            if id(param) not in lowp or param.grad is None:
                continue
            shadow = param.detach().float().requires_grad_(True)
            shadow.grad = param.grad.float()
            param_state = opt.state.pop(param, {})
            opt.state[shadow] = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype is torch.bfloat16
                                     and v.dim() > 0 else v) for k, v in param_state.items()}  # fmt: skip
            group["params"][i] = shadow
            shadows.append((group, i, param, shadow, shard_seed(tensor_seed(base, step, position[id(param)]), param)))

    def narrow(opt: torch.optim.Optimizer, *_: Any) -> None:
        with torch.no_grad():
            for group, i, param, shadow, seed in shadows:
                # The weight update is rounded stochastically: add noise below the 16 kept bits and
                # truncate; the copy into the bf16 parameter is then exact.
                local = sharding.local(param.data)
                bits = sr_bits(sharding.local(shadow.data).reshape(-1), _seed_tensor(seed, local.device))
                local.copy_(bits.view(torch.float32).view(local.shape))
                # Optimizer state goes back to bf16 rounded to nearest: it is not accumulated in
                # tiny increments the way weights are.
                shadow_state = opt.state.pop(shadow, {})
                opt.state[param] = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor)
                                        and v.dtype is torch.float32 and v.dim() > 0 else v)
                                    for k, v in shadow_state.items()}  # fmt: skip
                group["params"][i] = param
        shadows.clear()

    own_init_group = getattr(type(optimizer), "_init_group", None)
    if own_init_group is not None and type(optimizer).__module__.startswith("torch.optim."):
        # Every torch.optim optimizer but LBFGS and SparseAdam collects each group's tensors with
        # _init_group, once per group, inside step: widening there, rather than in a step pre-hook,
        # runs after the user's pre-hooks (they see and may change the bf16 gradients, or raise and
        # leave the optimizer as it was). Other classes may not call it from step: a pre-hook.
        def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            widen(self, group)
            return own_init_group(self, group, *args, **kwargs)

        optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
        handles.append(Restore(optimizer, "_init_group"))
    else:

        def widen_all(opt: torch.optim.Optimizer, *_: Any) -> None:
            for group in opt.param_groups:
                widen(opt, group)

        handles.append(optimizer.register_step_pre_hook(widen_all))
    handles.append(optimizer.register_step_post_hook(narrow))


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
    ids = {id(p) for p in lowp}
    _step_eagerly(optimizer, handles)
    if _fused_supported(optimizer) and _install_fused(optimizer, ids, handles):
        return True
    _install_generic(optimizer, ids, handles)
    return False


def _step_eagerly(optimizer: torch.optim.Optimizer, handles: list[Any]) -> None:
    """In a compiled training step, this optimizer's ``step`` runs eagerly (one graph break around it).

    The rounding counts steps in Python and swaps or updates tensors inside ``_init_group``, which
    Dynamo runs once, at trace time, when it compiles an optimizer's step: compiled, every later step
    would skip the update. Eagerly, Adam(W)'s fused kernel is compiled on its own. The step stays a
    bound method (LR schedulers wrap ``step.__func__``); one a scheduler already wrapped stays wrapped.
    """
    own = optimizer.__dict__.get("step")
    if own is None:
        eager = types.MethodType(torch._dynamo.disable(type(optimizer).step), optimizer)  # type: ignore[no-untyped-call]
    else:
        eager = torch._dynamo.disable(own)  # type: ignore[no-untyped-call]
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
