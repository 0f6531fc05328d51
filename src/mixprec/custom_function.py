"""``custom_fwd``/``custom_bwd`` for ``torch.autograd.Function``, and :func:`op`.

Same contract as ``torch.amp.custom_fwd``/``custom_bwd``, reading mixprec's
autocast state: ``backward`` runs with the autocast settings (dtype and
policy) that ``forward`` saw, and ``cast_inputs`` runs ``forward`` with autocast
off and floating inputs cast, when autocast is on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import handle_torch_function, has_torch_function

from mixprec._dtypes import parse_dtype
from mixprec.autocast import _eligible, autocast, get_autocast_dtype, get_autocast_policy, is_autocast_enabled

F = TypeVar("F", bound=Callable[..., Any])


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if _eligible(value, device_type) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, device_type, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, device_type, dtype) for k, v in value.items()}
    return value


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
        ctx._mixprec_dtype = get_autocast_dtype(device_type)
        ctx._mixprec_policy = get_autocast_policy(device_type)
        if target is None:
            ctx._mixprec_enabled = is_autocast_enabled(device_type)
            return fwd(*args, **kwargs)
        ctx._mixprec_enabled = False
        if is_autocast_enabled(device_type):
            with autocast(device_type, enabled=False):
                return fwd(*_cast(args, device_type, target), **_cast(kwargs, device_type, target))
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
    """Make a plain Python function visible to autocast, so a Policy can list it.

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

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        relevant = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if has_torch_function(relevant):
            return handle_torch_function(wrapper, relevant, *args, **kwargs)
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
