"""``custom_fwd``/``custom_bwd`` for ``torch.autograd.Function``, and :func:`op`.

Same contract as ``torch.amp.custom_fwd``/``custom_bwd`` (which also work inside
mixprec regions, since a region is a torch autocast region); these also carry the
mixprec policy: ``backward`` runs under the dtype and policy ``forward`` saw.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec._src import casting
from mixprec._src.amp import dispatch, thread_state
from mixprec._src.amp.autocast import TorchAutocast, autocast, get_autocast_policy
from mixprec._src.dtypes import parse_dtype
from mixprec._src.op_names import PYTHON_OPS

__all__ = ["F", "custom_bwd", "custom_fwd", "op"]

F = TypeVar("F", bound=Callable[..., Any])


def custom_fwd(fwd: F | None = None, *, device_type: str, cast_inputs: torch.dtype | str | None = None) -> Any:
    """Decorate ``forward`` of a custom ``torch.autograd.Function``.

    Args:
        device_type: the autocast device whose state is read (``"cpu"``, ``"cuda"``).
        cast_inputs: if given and autocast is on, ``forward`` runs with autocast off
            and its floating inputs on ``device_type`` cast to this dtype.
    """
    if not isinstance(device_type, str):
        raise TypeError(f"custom_fwd needs device_type as a string ('cpu', 'cuda'), got {device_type!r}")
    target = None if cast_inputs is None else parse_dtype(cast_inputs, what="cast_inputs")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        ctx._mixprec_dtype = torch.get_autocast_dtype(device_type)
        ctx._mixprec_policy = get_autocast_policy(device_type)
        enabled = torch.is_autocast_enabled(device_type)
        if target is None:
            ctx._mixprec_enabled = enabled
            return fwd(*args, **kwargs)
        ctx._mixprec_enabled = False
        if enabled:
            with TorchAutocast(device_type, enabled=False):
                return fwd(
                    *casting.cast_floating(args, target, device_type),
                    **casting.cast_floating(kwargs, target, device_type),
                )
        return fwd(*args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd: F | None = None, *, device_type: str) -> Any:
    """Decorate ``backward`` so it runs under the autocast settings ``forward`` saw."""
    if not isinstance(device_type, str):
        raise TypeError(f"custom_bwd needs device_type as a string ('cpu', 'cuda'), got {device_type!r}")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        if not hasattr(ctx, "_mixprec_enabled"):
            raise RuntimeError("custom_bwd needs forward decorated with mixprec.custom_fwd")
        policy = ctx._mixprec_policy
        dtype = None if policy.compute_dtype is not None else ctx._mixprec_dtype
        with autocast(device_type, dtype=dtype, enabled=ctx._mixprec_enabled, policy=policy):
            return bwd(*args, **kwargs)

    return decorate_bwd


def op(func: F) -> F:
    """Make a plain Python function an op a Policy can list, by its qualified name.

    Inside a mixprec region whose policy lists the function, its floating inputs
    are cast as the category says and its body runs with autocast off for that
    device, as torch's autocast kernels run their op; elsewhere it is called as is.

    Example:
        >>> import torch, mixprec
        >>> @mixprec.op
        ... def scaled_dot(a, b):
        ...     return (a * b).sum(-1)
        >>> policy = mixprec.get_policy("cpu").add("lower", scaled_dot)
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     scaled_dot(torch.randn(3), torch.randn(3)).dtype
        torch.bfloat16
    """
    module = getattr(func, "__module__", None) or ""
    qualname = getattr(func, "__qualname__", getattr(func, "__name__", "op"))
    name = f"py::{qualname}" if module.startswith("__") or not module else f"py::{module}.{qualname}"

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = thread_state.state()
        if st.policy:
            for t in dispatch.tensors_in(args, kwargs):
                device_type = t.device.type
                policy = st.policy.get(device_type)
                if policy is None or not torch.is_autocast_enabled(device_type):
                    break
                category = policy.op_table.get(name)
                if category is None:
                    break
                with TorchAutocast(device_type, enabled=False):
                    return dispatch.apply_category(category, func, args, kwargs, device_type, policy, name)
        return func(*args, **kwargs)

    wrapper.__dict__["__mixprec_op__"] = name  # op_names.op_name reads it: the name policies list it by
    PYTHON_OPS[name] = wrapper
    return wrapper  # type: ignore[return-value]
