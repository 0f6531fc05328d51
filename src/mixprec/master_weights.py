"""Low-precision weights: fp32 master weights (O2) and pure bf16 with stochastic rounding.

``model, optimizer = mixprec.prepare(model, optimizer, level=..., dtype=...)``:

* ``"O1"``: autocast only; the model's forward runs under :func:`mixprec.autocast`.
* ``"O2"``: parameters and buffers in ``dtype`` (modules kept in fp32 excepted, norm layers by
  default); the optimizer holds fp32 master copies. Each low-precision gradient is moved into
  its master as soon as backward has accumulated it (summed in fp32, the low-precision one
  freed), and the parameter's ``.grad`` reads and writes its master's gradient, so clipping and
  inspecting ``model.parameters()`` act on the gradients the optimizer uses. After
  ``optimizer.step()`` the low-precision weights are refreshed from the masters in one fused
  copy. Weights written into the model (``load_state_dict``, in-place writes) reach the masters.
  ``optimizer.state_dict()`` carries the masters, so a checkpoint resumes bit for bit.
  GradScaler needs nothing extra: ``scaler.step(optimizer)`` sees fp32 gradients.
* ``"bf16-sr"``: weights and optimizer state in bf16 only, no master copy. The optimizer runs
  in fp32 on transient copies; the weights are written back with stochastic rounding (round up
  with probability equal to the discarded fraction), so small updates survive on average
  instead of being rounded away; the state is written back rounded to nearest. The rounding
  noise comes from a seed and a counter saved in ``optimizer.state_dict()``, so a checkpoint
  resumes bit for bit.
* ``"bf16-pure"``: bf16 weights and state with round-to-nearest updates; the baseline that
  shows what stochastic rounding fixes.

At every level but O1 the model's forward runs under :func:`mixprec.autocast` (so ops on the
lists still run in fp32 where they should) and floating outputs are returned as fp32.

At every level ``p.grad`` for ``p`` in ``model.parameters()`` is the gradient the optimizer
steps with (at O2, the fp32 master's), so ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
clips the update.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._dtypes import LOW_PRECISION, NamedEnum, parse_dtype
from mixprec.autocast import autocast
from mixprec.policy import NORM_TYPES, ModuleRule, default_policy


class Level(NamedEnum):
    """Precision levels of :func:`prepare`."""

    O1 = "O1"
    O2 = "O2"
    BF16_SR = "bf16-sr"
    BF16_PURE = "bf16-pure"

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "level", "levels"


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


@dataclasses.dataclass
class _Prepared:
    level: Level
    dtype: torch.dtype
    device_type: str
    original_forward: Callable[..., Any]
    lowp_params: list[nn.Parameter]
    masters: list[torch.Tensor]  # O2: lowp_params[i] is refreshed from masters[i]
    handles: list[RemovableHandle]
    loaded_masters: dict[int, torch.Tensor] | None = None
    versions: list[int] = dataclasses.field(default_factory=list)  # O2: lowp_params' versions the masters match
    seeds: _SRSeeds | None = None  # bf16-sr: where the rounding noise comes from
    fused: bool = False  # bf16-sr: Adam(W) steps the bf16 weights with the compiled fused kernel


def master_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates (fp32 masters at O2).

    Their gradients are the ones ``model.parameters()`` show (at O2, ``p.grad`` of a low-precision
    parameter is its master's gradient), so either list can be clipped.
    """
    return [p for group in optimizer.param_groups for p in group["params"]]


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    level: Level | str = Level.O2,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    keep_types: type[nn.Module] | Iterable[type[nn.Module]] = NORM_TYPES,
    keep_names: str | Iterable[str] = (),
    output_dtype: torch.dtype | None = torch.float32,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Put ``model`` and ``optimizer`` at a precision level; returns them (changed in place).

    Args:
        model: an fp32 model, already on its device.
        optimizer: any ``torch.optim`` optimizer over the model's parameters, created after the
            model was moved.
        level: ``"O1"``, ``"O2"``, ``"bf16-sr"`` or ``"bf16-pure"``.
        dtype: the low precision (bf16 or fp16; the bf16 levels need bf16).
        keep_types, keep_names: modules kept in fp32, by type or qualified-name glob.
        output_dtype: floating outputs of the model's forward are cast to this (``None``: as computed).

    Raises:
        ValueError: a model not in fp32, an optimizer holding tensors that are not this model's
            parameters or holding one twice, a prepared model, a bad level or dtype.
    """
    level = Level.from_name(level)
    dtype = parse_dtype(dtype, what="prepare dtype", allowed=LOW_PRECISION)
    if level in (Level.BF16_SR, Level.BF16_PURE) and dtype is not torch.bfloat16:
        raise ValueError(f"level {level.value!r} keeps weights in bf16; pass dtype=torch.bfloat16 (or use level 'O2')")
    if level in (Level.O2, Level.BF16_SR) and isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            f"LBFGS re-evaluates the model inside step(), and level {level.value!r} updates the low-precision "
            "weights only after step(); use level 'O1' or 'bf16-pure' with LBFGS"
        )
    if hasattr(model, "_mixprec"):
        raise ValueError("this model was already prepared; call mixprec.export_fp32(model) first to prepare it anew")
    _check(model, optimizer)
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    # ModuleRule takes one type or pattern bare (keep_names="head") as well as several
    types: tuple[type[nn.Module], ...] = (keep_types,) if isinstance(keep_types, type) else tuple(keep_types)
    names: tuple[str, ...] = (keep_names,) if isinstance(keep_names, str) else tuple(keep_names)
    rule = ModuleRule(types=types, names=names) if (types or names) else None
    if rule is not None and not any(rule.matches(m, n) for n, m in model.named_modules()):
        rule = None  # nothing to keep: no module hooks at all
    policy = default_policy(device_type)
    if rule is not None:
        policy = dataclasses.replace(policy, module_rules=(rule,))

    original_forward = model.forward

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        region = autocast(device_type, dtype=dtype, policy=policy)
        region._naming_root = model  # the region opens inside model's call: name modules from model
        with region:
            out = original_forward(*args, **kwargs)
        return out if output_dtype is None else _cast_floating(out, output_dtype)

    state = _Prepared(level, dtype, device_type, original_forward, [], [], [])
    if level is not Level.O1:
        converted = [m for m in model.modules() if rule is None or not _module_is_kept(model, m, rule)]
        kept = _kept_parameters(model, rule)
        seen: set[int] = set()  # shared parameters are converted once
        for module in converted:
            for param in module.parameters(recurse=False):
                if id(param) not in kept and id(param) not in seen:
                    seen.add(id(param))
                    state.lowp_params.append(param)
        if level is Level.O2:
            odd = [p for p in state.lowp_params if type(p) is not nn.Parameter]
            if odd:
                raise ValueError(
                    f"level 'O2' redirects each low-precision parameter's .grad to its fp32 master and needs plain "
                    f"nn.Parameter objects, but one is a {type(odd[0]).__name__}; keep that module in fp32 with "
                    "keep_types=/keep_names=, or use level 'bf16-sr'"
                )
        for param in state.lowp_params:
            if level is Level.O2:
                state.masters.append(param.detach().clone().requires_grad_(param.requires_grad))
            param.data = param.data.to(dtype)
        for module in converted:
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype)
    if level is Level.O2:
        _install_o2(model, optimizer, state)
    elif level is Level.BF16_SR:
        _install_sr(optimizer, state)
    model.forward = forward  # type: ignore[method-assign]
    model._mixprec = state  # type: ignore[assignment]
    optimizer._mixprec = state  # type: ignore[attr-defined]
    return model, optimizer


def export_fp32(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    """Undo :func:`prepare`: fp32 parameters (from the masters at O2) and buffers, the original forward.

    With ``optimizer``, it is pointed back at the model's parameters, its state kept, so
    training can go on in fp32.
    """
    state: _Prepared | None = getattr(model, "_mixprec", None)
    if state is None:
        raise ValueError("this model was not prepared by mixprec.prepare")
    for handle in state.handles:
        handle.remove()
    with torch.no_grad():
        if state.level is Level.O2:
            _adopt_direct_writes(state)
            for param, master in zip(state.lowp_params, state.masters, strict=True):
                del _MASTER_OF[param]
                param.__class__ = nn.Parameter
                param.data = master.detach().clone()
                param.grad = None if master.grad is None else master.grad.clone()
        else:
            for param in state.lowp_params:
                param.data = param.data.float()
                param.grad = None if param.grad is None else param.grad.float()
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.dtype is state.dtype:
                    module._buffers[name] = buffer.float()
    if optimizer is not None and state.level is Level.O2:
        swap: dict[int, torch.Tensor] = {id(m): p for m, p in zip(state.masters, state.lowp_params, strict=True)}
        _replace_in_optimizer(optimizer, swap)
    if optimizer is not None:
        for group_state in optimizer.state.values():
            for key, value in group_state.items():
                if isinstance(value, torch.Tensor) and value.dtype is torch.bfloat16 and key != "step":
                    group_state[key] = value.float()
        optimizer.__dict__.pop("_mixprec", None)
    model.__dict__.pop("forward", None)
    del model._mixprec
    return model


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by parameters, their gradients, fp32 masters and optimizer state (each tensor once)."""
    seen: dict[int, int] = {}

    def count(t: torch.Tensor | None) -> None:
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t.numel() * t.element_size())

    for tensor in (*model.parameters(), *master_params(optimizer)):
        count(tensor)
        count(tensor.grad)
    for param_state in optimizer.state.values():
        for value in param_state.values():
            count(value if isinstance(value, torch.Tensor) and value.dim() > 0 else None)
    return sum(seen.values())


# ----- internals -------------------------------------------------------------------------


def _cast_floating(out: Any, dtype: torch.dtype) -> Any:
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.is_floating_point() and out.dtype is not torch.float64 else out
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_cast_floating(o, dtype) for o in out)
    if isinstance(out, list):
        return [_cast_floating(o, dtype) for o in out]
    if isinstance(out, dict):
        return {k: _cast_floating(v, dtype) for k, v in out.items()}
    return out


def _check(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    low = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype is not torch.float32]
    if low:
        raise ValueError(
            f"prepare() needs an fp32 model to make exact fp32 masters, but {low[0]!r} is "
            f"{dict(model.named_parameters())[low[0]].dtype}; call prepare() on the fp32 model instead of "
            "converting it first"
        )
    model_params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of this model (was the optimizer created "
                    "before the model was moved or copied?); create it from model.parameters() after moving the model"
                )
            if id(p) in seen:
                raise ValueError("a parameter appears in two optimizer param groups; give each parameter one group")
            seen.add(id(p))


def _module_is_kept(root: nn.Module, module: nn.Module, rule: ModuleRule) -> bool:
    names = {id(m): n for n, m in root.named_modules()}
    return rule.matches(module, names.get(id(module), ""))


def _kept_parameters(model: nn.Module, rule: ModuleRule | None) -> set[int]:
    kept: set[int] = set()
    if rule is None:
        return kept
    for name, module in model.named_modules():
        if rule.matches(module, name):
            kept.update(id(p) for p in module.parameters())
    return kept


def _replace_in_optimizer(optimizer: torch.optim.Optimizer, swap: dict[int, torch.Tensor]) -> None:
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            new = swap.get(id(p))
            if new is not None:
                group["params"][i] = new
                if p in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(p)


_TENSOR_GRAD: Any = vars(torch._C.TensorBase)["grad"]  # the gradient autograd accumulates into
_MASTER_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # O2 low-precision parameter -> its fp32 master


def _own_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s own gradient, under the override of :class:`_MasterGradParameter`."""
    return cast("torch.Tensor | None", _TENSOR_GRAD.__get__(param))


def _master_of(param: torch.Tensor) -> torch.Tensor | None:
    return cast("torch.Tensor | None", _MASTER_OF.get(param))  # type: ignore[no-untyped-call]


class _MasterGradParameter(nn.Parameter):
    """An O2 low-precision parameter whose ``.grad``, read or written from Python, is its fp32 master's.

    Autograd (C++) still accumulates into the parameter's own low-precision gradient, which is
    moved into the master at the end of backward. Python code that walks ``model.parameters()``
    (``clip_grad_norm_``, gradient-norm logging, ``zero_grad``) then reads and changes the
    gradients the optimizer steps with, not a subset of them.
    """

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        master = _master_of(self)
        return _own_grad(self) if master is None else master.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        master = _master_of(self)
        if master is None:
            _TENSOR_GRAD.__set__(self, value)
        else:  # a low-precision gradient widens exactly
            master.grad = None if value is None else value.to(master.dtype)


def _adopt_direct_writes(state: _Prepared) -> None:
    """Make each master match its weight where the weight was written since the masters were last synced.

    Writes into a weight (``load_state_dict``, ``p.copy_`` under ``no_grad``, ``nn.init``) bump its
    version counter; the refresh from the masters writes through ``.data``, which does not. A master
    that already rounds to the written weight is kept (it is more precise: a DDP broadcast of the
    same values, a checkpoint loaded into the model after the optimizer). Syncs only for weights
    that were written.
    """
    with torch.no_grad():
        for i, (param, master) in enumerate(zip(state.lowp_params, state.masters, strict=True)):
            if param._version != state.versions[i]:
                if not torch.equal(master.to(param.dtype), param):
                    master.copy_(param)
                state.versions[i] = param._version


def _install_o2(model: nn.Module, optimizer: torch.optim.Optimizer, state: _Prepared) -> None:
    master_of = {id(p): m for p, m in zip(state.lowp_params, state.masters, strict=True)}
    _replace_in_optimizer(optimizer, master_of)
    for param, master in zip(state.lowp_params, state.masters, strict=True):
        param.__class__ = _MasterGradParameter
        _MASTER_OF[param] = master
    state.versions = [p._version for p in state.lowp_params]

    def move_grad(param: torch.Tensor) -> None:
        # Sum into the fp32 master and free the low-precision gradient.
        grad = _own_grad(param)
        if grad is None:
            return
        master = master_of[id(param)]
        if master.grad is None:
            master.grad = grad.to(torch.float32)
        else:
            master.grad.add_(grad)
        _TENSOR_GRAD.__set__(param, None)

    def move_all() -> None:
        pending[0] = False
        for param in state.lowp_params:
            move_grad(param)

    pending = [False]

    def after_backward(param: torch.Tensor) -> None:
        # Move at the end of backward, not at once: DDP all-reduces param.grad in a callback queued
        # during backward. Ours queues itself once more, so that it runs after every callback queued
        # in the same backward, DDP's included.
        if not pending[0]:
            pending[0] = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(move_all))

    for param in state.lowp_params:
        state.handles.append(param.register_post_accumulate_grad_hook(after_backward))  # type: ignore[no-untyped-call]

    def refresh(*_: Any) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in state.lowp_params], state.masters)
        state.versions = [p._version for p in state.lowp_params]

    # Registered first, so it runs before any hook the user adds: the step starts from the weights
    # as written.
    state.handles.append(optimizer.register_step_pre_hook(lambda *_: _adopt_direct_writes(state)))
    state.handles.append(optimizer.register_step_post_hook(refresh))

    def load_into_masters(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                          local_metadata: dict[str, Any], *_: Any) -> None:  # fmt: skip
        # Runs before torch copies the values into the (low-precision) weights: the masters get
        # them at full precision.
        for name, param in module._parameters.items():
            master = master_of.get(id(param))
            value = state_dict.get(prefix + name)
            if master is None or param is None or not isinstance(value, torch.Tensor) or value.shape != param.shape:
                continue  # not ours, or torch reports the mismatch
            swaps = torch.__future__.get_swap_module_params_on_conversion()
            if local_metadata.get("assign_to_params_buffers") or swaps:
                raise ValueError(
                    "load_state_dict(assign=True) (or swapping tensors on conversion) would replace the "
                    "low-precision parameters that mixprec.prepare() made and the optimizer's masters "
                    "follow; load with assign=False, or load before prepare()"
                )
            with torch.no_grad():
                precise = value.is_floating_point() and value.element_size() >= 4
                if precise or not torch.equal(master.to(param.dtype), value.to(param.dtype)):
                    master.copy_(value)

    for module in model.modules():
        if any(id(p) in master_of for p in module._parameters.values() if p is not None):
            state.handles.append(module.register_load_state_dict_pre_hook(load_into_masters))  # type: ignore[no-untyped-call]

    def save_masters(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        _adopt_direct_writes(state)
        index = {id(p): i for i, p in enumerate(master_params(opt))}
        state_dict["mixprec_masters"] = {index[id(m)]: m.detach().clone() for m in state.masters}
        return state_dict

    def take_masters(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        masters = state_dict.pop("mixprec_masters", None)
        if masters is None:
            raise ValueError(
                "this optimizer state dict has no fp32 master weights: it was not saved from an optimizer "
                "prepared at O2, so loading it would lose precision; prepare the model the same way before saving"
            )
        state.loaded_masters = masters

    def load_masters(opt: torch.optim.Optimizer) -> None:
        masters, state.loaded_masters = state.loaded_masters, None
        params = master_params(opt)
        with torch.no_grad():
            for i, value in (masters or {}).items():
                params[int(i)].copy_(value)
        refresh()

    state.handles.append(optimizer.register_state_dict_post_hook(save_masters))
    state.handles.append(optimizer.register_load_state_dict_pre_hook(take_masters))  # type: ignore[arg-type]
    state.handles.append(optimizer.register_load_state_dict_post_hook(load_masters))


class _Restore:
    """A handle whose remove() drops an instance attribute that shadows the class's method."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


# Noise for stochastic rounding: a Weyl sequence, element i of a tensor gets the high 16 bits of
# (i * 0x9E3779B1 + seed) mod 2**32. With the seed uniform and fresh for every tensor and step, each
# element's noise is uniform on [0, 2**16) and independent from step to step, so the rounding is
# unbiased; neighbouring elements get evenly spread, not independent, noise (a dither). Computed
# in place from the index: no buffer to read and no generator call per element (torch's CPU
# generator makes about 200 M integers a second, slower than the optimizer step itself).
_WEYL = -1640531535  # 0x9E3779B1 (2**32 / golden ratio) as an int32
_MASK64 = (1 << 64) - 1


class _SRSeeds:
    """The per-tensor, per-step seeds of stochastic rounding: seed ``n`` is a hash of (base, n).

    A pure function of two integers, saved in ``optimizer.state_dict()`` (``"mixprec_sr"``), so a
    resumed run rounds exactly as an uninterrupted one, whatever torch's generators did meanwhile.
    The base is drawn from torch's CPU generator at ``prepare`` (``torch.manual_seed`` makes runs
    repeatable). Computed on the host: no generator call on the device and no sync.
    """

    def __init__(self, base: int) -> None:
        self.base, self.counter = base, 0

    def next(self, device: torch.device) -> torch.Tensor:
        """The next seed, as an int32 scalar tensor on ``device`` (a host-to-device copy, no sync)."""
        self.counter += 1  # a Python int: never wraps
        # splitmix64's finaliser: consecutive counters give independent-looking, uniform 64-bit values.
        z = (self.base + self.counter * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        high = (z ^ (z >> 31)) >> 32
        seed = torch.tensor(high - (1 << 32) if high >= 1 << 31 else high, dtype=torch.int32)
        return seed if device.type == "cpu" else seed.to(device, non_blocking=True)

    def state_dict(self) -> dict[str, int]:
        return {"base": self.base, "counter": self.counter}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.base, self.counter = int(saved["base"]), int(saved["counter"])


def _sr_bits(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (1-D) stochastically rounded to bf16 precision, as fp32 bits with 16 low zeros."""
    index = torch.arange(x.numel(), dtype=torch.int32, device=x.device)
    noise = ((index * _WEYL + seed) >> 16) & 0xFFFF
    return (x.view(torch.int32) + noise) & -(1 << 16)


def _adam_sr_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, seed: torch.Tensor,
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
    p.copy_(_sr_bits(p32, seed).view(torch.float32))
    m.copy_(m32)
    v.copy_(v32)


def _adam_scalars(group: dict[str, Any], step: float, decoupled: bool) -> torch.Tensor:
    lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decay, l2 = (1.0 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
    step_size = lr / (1.0 - beta1**step)
    inv_bc2_sqrt = 1.0 / (1.0 - beta2**step) ** 0.5
    return torch.tensor([decay, l2, beta1, 1.0 - beta1, beta2, 1.0 - beta2, step_size, inv_bc2_sqrt, eps])


_compiled_adam_sr: Callable[..., None] | None = None
_PROBE_GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _fused_adam_sr_supported(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(not g.get("amsgrad") and not g.get("maximize") and not g.get("capturable")
               and not g.get("differentiable") and not g.get("fused") for g in optimizer.param_groups)  # fmt: skip


def _install_fused_adam_sr(optimizer: torch.optim.Optimizer, state: _Prepared, seeds: _SRSeeds) -> bool:
    """Have Adam(W)'s own ``step`` update the bf16 weights with the compiled fused kernel, if it compiles.

    ``step`` itself is left alone (its hooks, profiling and LR schedulers' wrappers all stay in
    place): Adam's ``_init_group``, which ``step`` calls once per param group to collect the
    tensors to update, is overridden on this optimizer. It updates the bf16 weights of the group
    with the fused kernel and hands the rest (fp32 weights of kept modules) to Adam's own.
    """
    global _compiled_adam_sr
    if _compiled_adam_sr is None:
        try:
            compiled = cast(Callable[..., None], torch.compile(_adam_sr_update, fullgraph=True, dynamic=True))
            # The probe compiles the one graph every parameter uses: under no_grad as step() calls it
            # (grad mode is among the guards), and large, because inductor picks threads and loop
            # shapes from the first sizes it sees (a tiny probe gave a single-threaded kernel).
            probe = [torch.zeros(1 << 20, dtype=torch.bfloat16) for _ in range(4)]
            with torch.no_grad():
                compiled(*probe, torch.zeros((), dtype=torch.int32), _adam_scalars(_PROBE_GROUP, 1.0, True))
            _compiled_adam_sr = compiled
        except Exception:  # no C++ toolchain, an unsupported platform: keep the generic path
            return False
    kernel = _compiled_adam_sr
    lowp = {id(p) for p in state.lowp_params}
    adams_own = type(optimizer)._init_group  # type: ignore[attr-defined]

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)))
        by_step: dict[tuple[float, torch.device], torch.Tensor] = {}
        rest = []
        for p in group["params"]:
            if id(p) not in lowp or p.grad is None or not (p.is_contiguous() and p.grad.is_contiguous()):
                rest.append(p)
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            st["step"] += 1
            key = (float(st["step"]), p.device)  # the step count lives on the CPU: no sync
            scalars = by_step.get(key)
            if scalars is None:
                scalars = by_step[key] = _adam_scalars(group, key[0], decoupled).to(p.device)
            # 1-D views: one compiled graph serves every parameter, whatever its shape.
            flat = [t.view(-1) for t in (p.data, p.grad, st["exp_avg"], st["exp_avg_sq"])]
            kernel(*flat, seeds.next(p.device), scalars)
        return adams_own(self, {**group, "params": rest}, *args, **kwargs)

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    state.handles.append(_Restore(optimizer, "_init_group"))  # type: ignore[arg-type]
    return True


def _install_sr(optimizer: torch.optim.Optimizer, state: _Prepared) -> None:
    seeds = state.seeds = _SRSeeds(int(torch.randint(0, 1 << 62, ())))
    pending: list[dict[str, Any]] = []

    def save_seeds(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["mixprec_sr"] = seeds.state_dict()
        return state_dict

    def take_seeds(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        saved = state_dict.pop("mixprec_sr", None)
        if saved is not None:  # a state dict saved elsewhere: the noise goes on from this run's seeds
            pending.append(saved)

    def load_seeds(opt: torch.optim.Optimizer) -> None:
        while pending:
            seeds.load_state_dict(pending.pop())

    state.handles.append(optimizer.register_state_dict_post_hook(save_seeds))
    state.handles.append(optimizer.register_load_state_dict_pre_hook(take_seeds))  # type: ignore[arg-type]
    state.handles.append(optimizer.register_load_state_dict_post_hook(load_seeds))
    if _fused_adam_sr_supported(optimizer) and _install_fused_adam_sr(optimizer, state, seeds):
        state.fused = True
        return
    shadows: list[tuple[dict[str, Any], int, nn.Parameter, torch.Tensor]] = []
    lowp = {id(p) for p in state.lowp_params}

    def widen(opt: torch.optim.Optimizer, group: dict[str, Any]) -> None:
        # The optimizer steps fp32 shadows swapped into its param groups, state moved over. The
        # parameters themselves keep their dtype: changing it through .data would reset their
        # gradient accumulators, and with them the hooks DDP all-reduces through.
        for i, param in enumerate(group["params"]):
            if id(param) not in lowp or param.grad is None:
                continue
            shadow = param.detach().float().requires_grad_(True)
            shadow.grad = param.grad.float()
            param_state = opt.state.pop(param, {})
            opt.state[shadow] = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype is torch.bfloat16
                                     and v.dim() > 0 else v) for k, v in param_state.items()}  # fmt: skip
            group["params"][i] = shadow
            shadows.append((group, i, param, shadow))

    def narrow(opt: torch.optim.Optimizer, *_: Any) -> None:
        with torch.no_grad():
            for group, i, param, shadow in shadows:
                # The weight update is rounded stochastically: add noise below the 16 kept bits and
                # truncate; the copy into the bf16 parameter is then exact.
                bits = _sr_bits(shadow.data.reshape(-1), seeds.next(param.device))
                param.copy_(bits.view(torch.float32).view(param.shape))
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
        state.handles.append(_Restore(optimizer, "_init_group"))  # type: ignore[arg-type]
    else:

        def widen_all(opt: torch.optim.Optimizer, *_: Any) -> None:
            for group in opt.param_groups:
                widen(opt, group)

        state.handles.append(optimizer.register_step_pre_hook(widen_all))
    state.handles.append(optimizer.register_step_post_hook(narrow))
