"""autocast: torch.autocast's semantics over a TorchFunctionMode, driven by a Policy.

One ``_AutocastMode`` is pushed per thread when the outermost region opens and
popped when it closes; nested regions only swap the settings it reads, so an
inner ``enabled=False`` really turns casting off (stacked modes would each cast).

For every torch call the mode does one dict lookup (``func`` -> category):

* listed op: cast eligible inputs (floating, not fp64, on the autocast device)
  as the category says and call the op with the mode off, as torch's autocast
  kernels exclude the autocast key while they run;
* unlisted Python function (``F.mse_loss``, ``F.multi_head_attention_forward``):
  run its body with the mode on, so the builtins it calls are seen;
* anything else: call it unchanged.

Nothing here syncs with the device: casts are asynchronous ``Tensor.to`` calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, redispatch_function

from mixprec._dtypes import LOW_PRECISION, parse_dtype
from mixprec._op_tables import conditions
from mixprec.policy import PASS_THROUGH, ModuleRule, OpCategory, Policy, canonical, default_policy, get_policy

F = TypeVar("F", bound=Callable[..., Any])

_LOWER = OpCategory.LOWER
_FP32 = OpCategory.FP32
_FP32_SET_DTYPE = OpCategory.FP32_SET_DTYPE
_BANNED = OpCategory.BANNED
_SUPPORTED_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_CONDITIONS = conditions()
_Tensor = torch.Tensor
_float32 = torch.float32
_float64 = torch.float64


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The effective autocast state of one device type."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    policy: Policy
    cache_enabled: bool

    @property
    def dispatch(self) -> dict[Any, OpCategory | str]:
        return self.policy._dispatch  # type: ignore[attr-defined,no-any-return]


class _ThreadState:
    """Per-thread autocast state (torch keeps its autocast state thread-local too)."""

    def __init__(self) -> None:
        self.settings: dict[str, _Settings] = {}
        self.nesting = 0
        # id(fp32 leaf) -> (weakref to it, its low-precision copy, its version, grad mode at cast)
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int, bool]] = {}
        self.mode: _AutocastMode | None = None
        self.switched_on: dict[str, autocast] = {}
        # module-rule bookkeeping: (module, qualified name, settings to restore or None)
        self.module_stack: list[tuple[nn.Module | _CompiledWrapper, str, dict[str, _Settings] | None]] = []
        self.module_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.rule_users = 0


_tls = threading.local()


def _state() -> _ThreadState:
    state: _ThreadState | None = getattr(_tls, "state", None)
    if state is None:
        state = _tls.state = _ThreadState()
    return state


def _eligible(t: Any, device_type: str) -> bool:
    """torch's rule: a floating tensor, not fp64, on the autocast device."""
    return isinstance(t, _Tensor) and t.is_floating_point() and t.dtype is not _float64 and t.device.type == device_type


class _AutocastMode(TorchFunctionMode):
    def __init__(self, state: _ThreadState) -> None:
        super().__init__()
        self.state = state
        self.active: tuple[_Settings, ...] = ()
        self.single: _Settings | None = None
        self.dispatch: dict[Any, OpCategory | str] = {}
        self.redispatching: set[Any] = set()

    def refresh(self) -> None:
        self.active = tuple(s for s in self.state.settings.values() if s.enabled)
        self.single = self.active[0] if len(self.active) == 1 else None
        self.dispatch = self.single.dispatch if self.single is not None else {}

    def __torch_function__(
        self, func: Any, types_: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        settings = self.single
        if settings is not None:
            code = self.dispatch.get(func)
        elif not self.active:
            return func(*args, **kwargs)
        else:
            settings = self._settings_for(args, kwargs)
            code = settings.dispatch.get(func)
        if code is None:
            if type(func) is types.FunctionType and func not in self.redispatching:
                # A Python composite: run its body under this mode. The guard stops
                # Tensor methods that call super().method() from coming back here.
                self.redispatching.add(func)
                try:
                    with self:
                        return redispatch_function(func, types_, args, kwargs)  # type: ignore[no-untyped-call]
                finally:
                    self.redispatching.discard(func)
            return func(*args, **kwargs)
        if code is PASS_THROUGH or (kwargs and ("out" in kwargs or kwargs.get("dtype") is not None)):
            # torch.autocast registers no out= overloads, and leaves an explicit dtype alone.
            return func(*args, **kwargs)
        if code is _LOWER and func not in _CONDITIONS:  # the hot path (matmuls), inlined
            dtype, state = settings.dtype, self.state
            out = func(*_cast_args(args, dtype, settings, state), **_cast_kwargs(kwargs, dtype, settings, state))
            output_dtype = settings.policy.output_dtype
            return out if output_dtype is None else _cast_output(out, output_dtype)
        return _apply(settings, code, func, args, kwargs, self.state)  # type: ignore[arg-type]

    def _settings_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Settings:
        for value in (*args, *kwargs.values()):
            tensor = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(tensor, _Tensor):
                for s in self.active:
                    if s.device_type == tensor.device.type:
                        return s
                break
        return _Settings("none", False, _float32, self.active[0].policy, False)


def _apply(
    settings: _Settings, code: OpCategory, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], state: _ThreadState
) -> Any:
    if code is _BANNED:
        raise RuntimeError(f"{settings.policy.banned[func]} (mixprec policy {settings.policy.name!r}, banned op)")
    if func in _CONDITIONS and not _CONDITIONS[func](args, kwargs):
        return func(*args, **kwargs)
    device = settings.device_type
    if code is _LOWER:
        dtype = settings.dtype
        out = func(*_cast_args(args, dtype, settings, state), **_cast_kwargs(kwargs, dtype, settings, state))
        output_dtype = settings.policy.output_dtype
        return out if output_dtype is None else _cast_output(out, output_dtype)
    if code is _FP32:
        if torch.dtype in map(type, args):
            return func(*args, **kwargs)
        return func(*_cast_args(args, _float32, settings, state), **_cast_kwargs(kwargs, _float32, settings, state))
    if code is _FP32_SET_DTYPE:
        first = args[0] if args else next(iter(kwargs.values()), None)
        if _eligible(first, device) and torch.dtype not in map(type, args):
            return func(*args, **{**kwargs, "dtype": _float32})
        return func(*args, **kwargs)
    # PROMOTE: fp32 if any eligible input is fp32, else the compute dtype.
    target = settings.dtype
    dtypes = set()
    for value in (*args, *kwargs.values()) if kwargs else args:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, _Tensor) and _eligible(t, device):
                dtypes.add(t.dtype)
    if _float32 in dtypes:
        target = _float32
    elif len(dtypes - {target}) > 0:
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} got {sorted(map(str, dtypes))} inputs under autocast with "
            f"{target}; cast them to one dtype first"
        )
    if not dtypes - {target}:
        return func(*args, **kwargs)  # every input is already in the target dtype
    return func(*_cast_args(args, target, settings, state), **_cast_kwargs(kwargs, target, settings, state))


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, settings: _Settings, state: _ThreadState) -> torch.Tensor:
    """Cast an eligible tensor; low-precision copies of fp32 weights come from the cache."""
    # torch.autocast's heuristic (from Apex): cache low-precision copies of fp32 leaves
    # that require grad (model weights), one per outermost region.
    if (
        t.requires_grad
        and t.is_leaf
        and dtype is settings.dtype
        and t.dtype is _float32
        and dtype is not _float32
        and settings.cache_enabled
        and not torch.compiler.is_compiling()  # first: Dynamo cannot trace _is_view()
        and not t._is_view()
    ):
        key = id(t)
        grad_mode = torch.is_grad_enabled()
        hit = state.cache.get(key)
        # The version check drops a copy whose source was updated in place (an optimizer
        # step inside a long-lived region); the grad-mode check one made under no_grad.
        if hit is not None and hit[0]() is t and hit[2] == t._version and hit[3] == grad_mode:
            return hit[1]
        cast = t.to(dtype=dtype)
        state.cache[key] = (weakref.ref(t), cast, t._version, grad_mode)
        return cast
    # to(dtype=...) parses twice as fast as to(dtype); both are aten::to.dtype.
    return t.to(dtype=dtype)


def _needs_cast(t: torch.Tensor, dtype: torch.dtype, device_type: str) -> bool:
    if t.dtype is dtype or t.dtype is _float64 or not t.is_floating_point():
        return False
    # t.is_cpu is several times cheaper than t.device.type.
    return t.is_cpu if device_type == "cpu" else t.device.type == device_type


def _cast_value(value: Any, dtype: torch.dtype, settings: _Settings, state: _ThreadState) -> Any:
    if isinstance(value, _Tensor):
        return _cast_tensor(value, dtype, settings, state) if _needs_cast(value, dtype, settings.device_type) else value
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, _Tensor) for v in value):
        return type(value)(_cast_value(v, dtype, settings, state) for v in value)
    return value


def _cast_args(args: tuple[Any, ...], dtype: torch.dtype, settings: _Settings, state: _ThreadState) -> list[Any]:
    device_type = settings.device_type
    out = []
    for a in args:
        if isinstance(a, _Tensor):
            if _needs_cast(a, dtype, device_type):
                a = _cast_tensor(a, dtype, settings, state)
        elif isinstance(a, (list, tuple)):
            a = _cast_value(a, dtype, settings, state)
        out.append(a)
    return out


def _cast_kwargs(
    kwargs: dict[str, Any], dtype: torch.dtype, settings: _Settings, state: _ThreadState
) -> dict[str, Any]:
    for value in kwargs.values():
        if isinstance(value, (_Tensor, list, tuple)):
            return {k: _cast_value(v, dtype, settings, state) for k, v in kwargs.items()}
    return kwargs  # no tensors among them (the common case: reduction=..., weight=None)


def _cast_output(out: Any, dtype: torch.dtype) -> Any:
    if isinstance(out, _Tensor):
        return out.to(dtype=dtype) if out.is_floating_point() and out.dtype is not _float64 else out
    if isinstance(out, tuple):
        items = [_cast_output(o, dtype) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    return out


def _default_dtype(device_type: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(device_type)
    except Exception:  # a device type this torch build has no autocast state for
        return torch.float16


class autocast:  # noqa: N801 - the name torch.autocast users type
    """Run chosen ops in low precision: a drop-in for ``torch.autocast``, with a policy.

    Same arguments and semantics as ``torch.autocast``; use it as a context manager
    or a decorator. Regions nest (an inner ``enabled=False`` or another ``dtype``
    wins until it exits), state is thread-local, and it is restored when the body
    raises. Low-precision copies of fp32 weights are cached for the outermost
    region and released when it exits.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (also ``"xpu"``, ``"mps"``, ``"hpu"``).
        dtype: the compute dtype (``torch.bfloat16``/``torch.float16`` or ``"bf16"``/``"fp16"``);
            default: the policy's, else ``torch.get_autocast_dtype(device_type)``.
        enabled: ``False`` turns autocast off for this device inside the region.
        cache_enabled: cache weight casts; default ``True``.
        policy: a :class:`mixprec.Policy`, a built-in name (``"cpu"``, ``"cuda"``) or a
            short string (``"compute=bf16,output=fp32"``); default: the device's built-in.

    Raises:
        ValueError: unknown device type, non-floating or unsupported dtype, bad policy;
            the message says what is valid.

    Example:
        >>> import torch, mixprec
        >>> layer = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu", dtype=torch.bfloat16):
        ...     y = layer(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | str | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
    ) -> None:
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a string such as 'cpu' or 'cuda', got {type(device_type).__name__}")
        if device_type not in _SUPPORTED_DEVICES:
            raise ValueError(f"unknown device_type {device_type!r}; valid: {', '.join(_SUPPORTED_DEVICES)}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self.device_type = device_type
        self._args = (device_type, dtype, enabled, cache_enabled, policy)
        resolved = default_policy(device_type) if policy is None else get_policy(policy, device_type)
        if not torch.compiler.is_compiling():
            resolved = canonical(resolved)
        if dtype is not None:
            dtype = parse_dtype(dtype, what="autocast dtype", allowed=LOW_PRECISION)
            if resolved.compute_dtype is not None and resolved.compute_dtype is not dtype:
                raise ValueError(
                    f"dtype={dtype} conflicts with policy {resolved.name!r} whose compute dtype is "
                    f"{resolved.compute_dtype}; pass one of them"
                )
        else:
            dtype = resolved.compute_dtype or _default_dtype(device_type)
        self.fast_dtype = dtype
        self.policy = resolved
        if enabled and device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "mixprec.autocast: device_type 'cuda' was given but CUDA is not available; autocast is disabled",
                stacklevel=2,
            )
            enabled = False
        self._enabled = enabled
        self._cache_enabled = True if cache_enabled is None else bool(cache_enabled)
        self._prev: dict[str, _Settings] | None = None
        self._state: _ThreadState | None = None
        self._switch_depth = -1

    def __enter__(self) -> autocast:
        if self._state is not None:
            raise RuntimeError("this mixprec.autocast object is already active; create a new one to nest")
        state = _state()
        self._state = state
        self._prev = state.settings
        settings = _Settings(self.device_type, self._enabled, self.fast_dtype, self.policy, self._cache_enabled)
        state.settings = {**state.settings, self.device_type: settings}
        state.nesting += 1
        if self.policy.module_rules and self._enabled:
            _count_rule_user(state, +1)
        if state.mode is None:
            mode = _AutocastMode(state)
            mode.__enter__()  # type: ignore[no-untyped-call]
            state.mode = mode
        state.mode.refresh()
        return self

    def __exit__(self, *exc: object) -> None:
        state = self._state
        if state is None or self._prev is None:
            raise RuntimeError("mixprec.autocast.__exit__ called without __enter__")
        state.settings = self._prev
        state.nesting -= 1
        if self.policy.module_rules and self._enabled:
            _count_rule_user(state, -1)
        if state.nesting == 0:
            state.cache.clear()
            state.module_stack.clear()
            if state.mode is not None:
                mode, state.mode = state.mode, None
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        elif state.mode is not None:
            state.mode.refresh()
        self._state = None
        self._prev = None

    def __call__(self, func: F) -> F:
        device_type, dtype, enabled, cache_enabled, policy = self._args

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(device_type, dtype, enabled, cache_enabled, policy=policy):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


# ----- module rules ---------------------------------------------------------------

_hooks_lock = threading.Lock()
_hook_users = 0
# The hooks sit in torch's global hook dicts under a fixed key rather than behind a
# RemovableHandle: creating a handle bumps a class counter, which Dynamo cannot trace,
# while dict stores it can, so a region with rules can open inside a compiled function.
_HOOK_KEY = -0x6D69787072  # negative: never one of torch's handle ids
_module = nn.modules.module
_OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


class _CompiledWrapper:
    """Stands in for a torch.compile wrapper module on the module stack."""

    def __init__(self, ident: int) -> None:
        self.ident = ident


def _count_rule_user(state: _ThreadState, delta: int) -> None:
    """A region with rules opens (+1) or closes (-1); the first installs the hooks, the last removes them."""
    global _hook_users
    state.rule_users += delta
    # Dynamo cannot enter a lock; tracing is single-threaded.
    with contextlib.nullcontext() if torch.compiler.is_compiling() else _hooks_lock:
        _hook_users += delta
        if delta > 0 and _hook_users == 1:
            _module._global_forward_pre_hooks[_HOOK_KEY] = _pre_hook
            _module._global_forward_hooks[_HOOK_KEY] = _post_hook
            _module._global_forward_hooks_always_called[_HOOK_KEY] = True
        elif delta < 0 and _hook_users == 0:
            del _module._global_forward_pre_hooks[_HOOK_KEY]
            del _module._global_forward_hooks[_HOOK_KEY]
            del _module._global_forward_hooks_always_called[_HOOK_KEY]


def _qualified_name(state: _ThreadState, module: nn.Module) -> str:
    if not state.module_stack:
        return ""
    parent, parent_name, _ = state.module_stack[-1]
    if isinstance(parent, _CompiledWrapper):  # torch.compile's wrapper runs only its _orig_mod: same name
        return parent_name
    compiling = torch.compiler.is_compiling()  # then names are worked out once, at trace time
    name = None if compiling else state.module_names.get(module)
    if name is not None:
        return name
    for child_name, child in parent.named_modules():
        if child is module and child_name:
            if "_orig_mod" in child_name:  # under a torch.compile wrapper: name it as the plain model does
                child_name = ".".join(part for part in child_name.split(".") if part != "_orig_mod")
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            break
    else:
        name = f"{parent_name}.<{type(module).__name__}>" if parent_name else f"<{type(module).__name__}>"
    if not compiling:
        state.module_names[module] = name
    return name


def _match_rule(rules: tuple[ModuleRule, ...], module: nn.Module, name: str) -> ModuleRule | None:
    for rule in rules:
        if rule.matches(module, name):
            return rule
    return None


def _pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    state = _state()
    if state.rule_users == 0 or state.mode is None:
        return None
    name = _qualified_name(state, module)
    if isinstance(module, _OptimizedModule):
        # torch.compile's wrapper: its _orig_mod runs the hooks again and takes this name,
        # found here, eagerly. The stack holds a stand-in: Dynamo must not reach the
        # module it traces through another path.
        state.module_stack.append((_CompiledWrapper(id(module)), name, None))
        return None
    restore: dict[str, _Settings] | None = None
    new_args = None
    for device_type, settings in state.settings.items():
        if not settings.enabled or not settings.policy.module_rules:
            continue
        rule = _match_rule(settings.policy.module_rules, module, name)
        if rule is None:
            continue
        if restore is None:
            restore = state.settings
        inner = _Settings(device_type, True, rule.dtype, settings.policy._without_rules, settings.cache_enabled)  # type: ignore[attr-defined]
        state.settings = {**state.settings, device_type: inner}
        new_args = tuple(
            a.to(rule.dtype) if _eligible(a, device_type) and a.dtype is not rule.dtype else a
            for a in (args if new_args is None else new_args)
        )
    state.module_stack.append((module, name, restore))
    if restore is not None:
        state.mode.refresh()
    return new_args


def _post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    state = _state()
    if state.rule_users == 0 or not state.module_stack:
        return
    top = state.module_stack[-1][0]
    if top is not module and not (isinstance(top, _CompiledWrapper) and top.ident == id(module)):
        return
    _, _, restore = state.module_stack.pop()
    if restore is not None:
        state.settings = restore
        if state.mode is not None:
            state.mode.refresh()


# ----- queries and the global switch ----------------------------------------------


def is_autocast_enabled(device_type: str = "cpu") -> bool:
    """Whether mixprec autocast is on for ``device_type`` in this thread."""
    settings = _state().settings.get(device_type)
    return settings is not None and settings.enabled


def get_autocast_dtype(device_type: str = "cpu") -> torch.dtype:
    """The compute dtype in force for ``device_type`` (the default when autocast is off)."""
    settings = _state().settings.get(device_type)
    return settings.dtype if settings is not None else _default_dtype(device_type)


def get_autocast_policy(device_type: str = "cpu") -> Policy:
    """The policy in force for ``device_type`` (its built-in one when autocast is off)."""
    settings = _state().settings.get(device_type)
    return settings.policy if settings is not None else default_policy(device_type)


def set_autocast_enabled(
    enabled: bool,
    device_type: str = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    policy: Policy | str | None = None,
    cache_enabled: bool | None = None,
) -> None:
    """Switch autocast on or off for this thread without a ``with`` block.

    For code with no single entry point (MegEngine's ``amp.enabled = True``).
    Switching on while on replaces the settings. Weight casts stay cached while
    the switch is on; a cached copy is dropped as soon as its weight changes.

    Raises:
        RuntimeError: switching off while a ``with mixprec.autocast`` region opened
            after the switch is still active.
    """
    state = _state()
    current = state.switched_on.get(device_type)
    if current is not None:
        if state.nesting != current._switch_depth:
            raise RuntimeError(
                "cannot switch autocast while a `with mixprec.autocast(...)` region opened after the switch "
                "is still active; leave that region first"
            )
        del state.switched_on[device_type]
        current.__exit__(None, None, None)
    if enabled:
        region = autocast(device_type, dtype, True, cache_enabled, policy=policy)
        region.__enter__()
        region._switch_depth = state.nesting
        state.switched_on[device_type] = region
