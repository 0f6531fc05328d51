"""Kernels at torch's Autocast dispatch keys for the ops where a policy differs from torch's list.

torch.autocast casts inside the dispatcher: each listed op has a kernel for the
device's Autocast key (``AutocastCPU``, ``AutocastCUDA``, ...) that casts its
inputs and redispatches below autocast. A mixprec policy equal to torch's list
for a device needs nothing more. For a policy that moves, adds or removes ops,
mixprec registers a Python kernel for each overload of each differing op while
a region with that policy is open anywhere in the process (reference-counted;
torch's own kernel comes back when the last such region closes).

The kernel reads the policy in force in its thread. Where none is (another
thread, a region with a built-in policy, plain ``torch.autocast``), it does
exactly what torch's kernel for that op does, so other code computes the same
numbers while the kernel is registered.

Nothing here syncs with the device: casts are asynchronous ``Tensor.to`` calls.
"""

from __future__ import annotations

import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet, _ExcludeDispatchKeyGuard

from mixprec._src.amp.thread_state import ThreadState, state
from mixprec._src.casting import eligible
from mixprec._src.errors import CheckpointReplayError
from mixprec._src.op_names import PYTHON_OPS
from mixprec._src.policy.rules import OpCategory, Policy, default_policy

__all__ = [
    "AUTOCAST_KEYS",
    "acquire",
    "apply_category",
    "cast_all",
    "check_checkpoint",
    "never_a_frame",
    "registered",
    "release",
    "tensors_in",
]

_LOWER = OpCategory.LOWER
_FP32 = OpCategory.FP32
_FP32_SET_DTYPE = OpCategory.FP32_SET_DTYPE
_PROMOTE = OpCategory.PROMOTE
_BANNED = OpCategory.BANNED
_Tensor = torch.Tensor
_float32 = torch.float32
_float64 = torch.float64

#: device type -> torch's Autocast dispatch key for it.
AUTOCAST_KEYS = {
    "cpu": "AutocastCPU",
    "cuda": "AutocastCUDA",
    "xpu": "AutocastXPU",
    "mps": "AutocastMPS",
    "hpu": "AutocastHPU",
}


# ----- casting, as torch's autocast kernels do ---------------------------------------


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, st: ThreadState) -> torch.Tensor:
    # torch's cached_cast: low-precision copies of fp32 leaves that require grad (weights)
    # are made once per outermost region, so every use shares one cast and one grad.
    if (
        t.requires_grad
        and t.is_leaf
        and t.dtype is _float32
        and dtype is not _float32
        and torch.is_autocast_cache_enabled()
        and not torch.compiler.is_compiling()  # first: Dynamo cannot trace _is_view()
        and not t._is_view()
    ):
        grad_mode = torch.is_grad_enabled()
        hit = st.cache.get(id(t))
        if hit is not None and hit[0]() is t and hit[2] == grad_mode:
            return hit[1]
        cast = t.to(dtype=dtype)
        st.cache[id(t)] = (weakref.ref(t), cast, grad_mode)
        return cast
    return t.to(dtype=dtype)


def _cast(value: Any, dtype: torch.dtype, device_type: str, st: ThreadState) -> Any:
    if isinstance(value, _Tensor):
        if value.dtype is not dtype and eligible(value, device_type):
            return _cast_tensor(value, dtype, st)
        return value
    if isinstance(value, (list, tuple)) and any(isinstance(v, _Tensor) for v in value):
        return type(value)(_cast(v, dtype, device_type, st) for v in value)
    return value


def cast_all(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, device_type: str) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with every eligible tensor cast to ``dtype``."""
    st = state()
    return (
        tuple(_cast(a, dtype, device_type, st) for a in args),
        {k: _cast(v, dtype, device_type, st) for k, v in kwargs.items()},
    )


def tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op call passes, directly or in a list or tuple."""
    found = []
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, _Tensor):
                found.append(t)
    return found


def _promote_dtype(tensors: list[torch.Tensor], device_type: str) -> torch.dtype:
    # torch's prioritize(): fp32 wins over the lower dtype; fp64 inputs are ignored.
    lower = torch.get_autocast_dtype(device_type)
    current = lower
    for t in tensors:
        if not eligible(t, device_type):
            continue
        if current is _float32 or t.dtype is _float32:
            current = _float32
        elif t.dtype is not lower:
            raise RuntimeError(
                f"autocast got a {t.dtype} input for an op that promotes to the widest input dtype under "
                f"autocast with {lower}; cast the inputs to one dtype first"
            )
    return current


def _cast_output(out: Any, dtype: torch.dtype) -> Any:
    if isinstance(out, _Tensor):
        return out.to(dtype=dtype) if out.is_floating_point() and out.dtype is not _float64 else out
    if isinstance(out, tuple):
        return tuple(_cast_output(o, dtype) for o in out)
    return out


def apply_category(
    category: OpCategory | None,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    policy: Policy | None,
    name: str,
    dtype_index: int | None = None,
) -> Any:
    """Run ``func`` (the op policies call ``name``) as an autocast kernel of ``category`` would
    (autocast already excluded)."""
    if category is None:
        return func(*args, **kwargs)
    if category is _LOWER:
        args, kwargs = cast_all(args, kwargs, torch.get_autocast_dtype(device_type), device_type)
        out = func(*args, **kwargs)
        if policy is not None and policy.output_dtype is not None:
            return _cast_output(out, policy.output_dtype)
        return out
    if category is _FP32:
        args, kwargs = cast_all(args, kwargs, _float32, device_type)
        return func(*args, **kwargs)
    if category is _PROMOTE:
        tensors = tensors_in(args, kwargs)
        args, kwargs = cast_all(args, kwargs, _promote_dtype(tensors, device_type), device_type)
        return func(*args, **kwargs)
    if category is _FP32_SET_DTYPE:
        # torch's fp32_set_opt_dtype: only when the first argument is eligible, and never
        # over a dtype the caller gave.
        if args and eligible(args[0], device_type) and dtype_index is not None:
            if len(args) > dtype_index:
                if args[dtype_index] is None:
                    args = (*args[:dtype_index], _float32, *args[dtype_index + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": _float32}
        return func(*args, **kwargs)
    assert category is _BANNED
    text = policy.banned.get(name) if policy is not None else None
    raise RuntimeError(text or f"{name} is banned under autocast")


# ----- checkpointing: an edited policy needs mixprec.checkpoint_context ------------------

_CHECKPOINT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__


def check_checkpoint(st: ThreadState) -> None:
    """Raise if a checkpointed forward runs an edited policy that its recompute would lose."""
    if st.captured:
        return
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook"):
        raise CheckpointReplayError(
            "torch.utils.checkpoint is recomputing part of a mixprec.autocast region whose policy differs from "
            "torch's list (edited ops or module rules); torch replays only its own autocast state, so the "
            "recompute would run other ops in other dtypes. Pass context_fn=mixprec.checkpoint_context to "
            "checkpoint (Hugging Face transformers 5: model.activation_checkpointing_enable("
            "activation_checkpointing_kwargs={'use_reentrant': False, 'context_fn': mixprec.checkpoint_context}); "
            "earlier versions: gradient_checkpointing_enable(gradient_checkpointing_kwargs={...}))"
        )
    if not torch.is_grad_enabled():  # reentrant checkpoint runs its forward under no_grad
        frame: types.FrameType | None = sys._getframe(1)
        for _ in range(200):
            if frame is None:
                break
            if frame.f_code is _CHECKPOINT_FORWARD:
                raise CheckpointReplayError(
                    "reentrant torch.utils.checkpoint cannot carry a mixprec policy that differs from torch's "
                    "list (edited ops or module rules) into its recompute; use checkpoint(..., "
                    "use_reentrant=False, context_fn=mixprec.checkpoint_context)"
                )
            frame = frame.f_back


# ----- kernels and their registration ------------------------------------------------


def never_a_frame(func: Callable[..., Any]) -> None:
    """Tell Dynamo never to compile ``func`` (or what it calls) as a frame of its own.

    Dynamo compiles the frames that eager code calls while a compiled function runs (after it
    fell back to eager for part of it); code that branches on ``torch.compiler.is_compiling()``
    or runs inside the dispatcher must not become such a frame. Being traced as part of a
    compiled caller is unaffected.
    """
    eval_frame: Any = torch._dynamo.eval_frame
    skip = eval_frame.FrameAction.SKIP
    eval_frame.set_code_exec_strategy(func.__code__, eval_frame.FrameExecStrategy(skip, skip))


_lock = threading.Lock()
# (qualified overload name, device type) -> [Library, users]
_registered: dict[tuple[str, str], list[Any]] = {}
# dispatch key -> overloads torch registered a kernel for (read before mixprec registers any)
_torch_kernels: dict[str, frozenset[str]] = {}
_plans: dict[tuple[Policy, str], tuple[tuple[str, Any, str, OpCategory | None, int | None], ...]] = {}


def _kernels_of_torch(key: str) -> frozenset[str]:
    found = _torch_kernels.get(key)
    if found is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        found = frozenset(n for n in torch._C._dispatch_get_all_op_names() if has(n, key))
        _torch_kernels[key] = found
    return found


def _qualified(overload: Any) -> str:
    schema = overload._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def _plan(policy: Policy, device_type: str) -> tuple[tuple[str, Any, str, OpCategory | None, int | None], ...]:
    """(qualified overload, overload, op name, torch's category, dtype arg index) for each kernel needed."""
    cached = _plans.get((policy, device_type))
    if cached is not None:
        return cached
    key = AUTOCAST_KEYS[device_type]
    builtin = default_policy(device_type).op_table
    table = policy.op_table
    names = {n for n in set(table) | set(builtin) if table.get(n) is not builtin.get(n)}
    if policy.output_dtype is not None:
        names |= {n for n, c in table.items() if c is _LOWER}
    torch_has = _kernels_of_torch(key)
    plan = []
    for name in sorted(names - set(PYTHON_OPS)):
        namespace, _, short = name.rpartition("::")
        packet = getattr(getattr(torch.ops, namespace or "aten"), short)
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            schema = overload._schema
            if schema.is_mutable:  # out= and in-place overloads: torch.autocast leaves them alone too
                continue
            if not any("Tensor" in str(a.type) for a in schema.arguments):  # scalar-only overloads
                continue
            qualified = _qualified(overload)
            own = builtin.get(name) if qualified in torch_has else None
            dtype_index = next((i for i, a in enumerate(schema.arguments) if a.name == "dtype"), None)
            plan.append((qualified, overload, name, own, dtype_index))
    result = tuple(plan)
    _plans[(policy, device_type)] = result
    return result


def _make_kernel(
    overload: Any, name: str, device_type: str, builtin: OpCategory | None, dtype_index: int | None
) -> Callable[..., Any]:
    exclude = DispatchKeySet(getattr(DispatchKey, AUTOCAST_KEYS[device_type]))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        st = state()
        policy = st.edited.get(device_type)
        if policy is None:
            category = builtin
        else:
            category = policy.op_table.get(name)
            check_checkpoint(st)
            if torch.compiler.is_compiling() and not any(r.traced for r in st.regions):
                raise RuntimeError(
                    "torch.compile is tracing code inside a mixprec.autocast region opened outside the compiled "
                    "code, with a policy that differs from torch's list; the compiled graph could not follow a "
                    "later policy change. Open the region inside the compiled function (or module forward): "
                    "mixprec.prepare(model, optimizer, 'O1', policy=...) does for a model, and so does a "
                    "mixprec.Recipe with compile=True"
                )
        with _ExcludeDispatchKeyGuard(exclude):
            return apply_category(category, overload, args, kwargs, device_type, policy, name, dtype_index)

    # A dispatcher kernel, never a frame for Dynamo to compile (it would be one when eager code
    # that Dynamo fell back to calls the op).
    never_a_frame(kernel)
    return kernel


def acquire(policy: Policy, device_type: str) -> tuple[Any, ...]:
    """Register the kernels ``policy`` needs on ``device_type``; returns what to :func:`release`."""
    if device_type not in AUTOCAST_KEYS:
        return ()
    with _lock:
        plan = _plan(policy, device_type)
        for qualified, overload, name, builtin, dtype_index in plan:
            entry = _registered.get((qualified, device_type))
            if entry is not None:
                entry[1] += 1
                continue
            namespace = overload.namespace
            library = torch.library.Library(namespace, "IMPL")  # type: ignore[no-untyped-call]
            with warnings.catch_warnings():
                # torch warns once that a kernel overrides its own; that is the point here.
                warnings.simplefilter("ignore", UserWarning)
                library.impl(  # type: ignore[no-untyped-call]
                    qualified.split("::", 1)[1],
                    _make_kernel(overload, name, device_type, builtin, dtype_index),
                    AUTOCAST_KEYS[device_type],
                )
            _registered[(qualified, device_type)] = [library, 1]
    return tuple((qualified, device_type) for qualified, *_ in plan)


def release(keys: tuple[Any, ...]) -> None:
    """Undo one :func:`acquire`; a kernel no region needs any more is removed (torch's comes back)."""
    if not keys:
        return
    with _lock:
        for key in keys:
            entry = _registered[key]
            entry[1] -= 1
            if entry[1] == 0:
                entry[0]._destroy()
                del _registered[key]


def registered() -> list[str]:
    """The overloads mixprec holds kernels for now, as ``"aten::mm@cpu"``; for tests and reports."""
    with _lock:
        return sorted(f"{q}@{d}" for q, d in _registered)
