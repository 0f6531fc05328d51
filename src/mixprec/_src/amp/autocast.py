"""autocast: a torch.autocast region, with the policy's differences applied at the dispatcher.

``mixprec.autocast`` opens a real ``torch.autocast`` region: torch's autocast
state is set exactly as ``torch.autocast`` sets it, so torch and every library
that asks ``torch.is_autocast_enabled()`` see it, ``torch.utils.checkpoint``
replays it, and torch's own kernels cast, inside C++ composites (LSTM, einsum)
too. With a built-in policy that is all: the region is torch's, bit for bit and
at its speed.

A policy that differs from torch's list for the device (ops moved, added or
removed, an output dtype) gets kernels for the differing ops at the device's
Autocast dispatch key while the region is open (``region`` puts it in force,
``dispatch`` holds the kernels). Per-module rules switch torch's autocast
dtype/enabled state, and the policy in force, at module boundaries
(``module_rules``). This module holds the user's side: the region object, the
queries and the on/off switch.

Nothing here syncs with the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec._src.amp import dispatch, region
from mixprec._src.amp.thread_state import state as _state
from mixprec._src.dtypes import parse_dtype
from mixprec._src.policy.grammar import get_policy
from mixprec._src.policy.rules import POLICIES, Policy, default_policy

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["autocast", "get_autocast_dtype", "get_autocast_policy", "is_autocast_enabled", "set_autocast_enabled"]

_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# torch's class, held here: code that swaps torch.autocast for mixprec's must not make it recurse.
TorchAutocast = torch.amp.autocast_mode.autocast


class autocast:  # noqa: N801 - the name torch.autocast users type
    """Run chosen ops in low precision: a drop-in for ``torch.autocast``, with a policy.

    A region is a ``torch.autocast`` region: same arguments, same semantics, same
    state as torch sees it (``torch.is_autocast_enabled()``, checkpointing, nested
    ``torch.autocast(enabled=False)``). Use it as a context manager or a decorator.
    A policy that differs from torch's list for ``device_type`` applies its
    differences through dispatcher kernels while the region is open.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mps"``, ``"hpu"`` (as torch takes).
        dtype: the compute dtype (a ``torch.dtype`` or ``"bf16"``/``"fp16"``); default:
            the policy's, else ``torch.get_autocast_dtype(device_type)``.
        enabled: ``False`` turns autocast off for this device inside the region.
        cache_enabled: cache weight casts; default ``True``.
        policy: a :class:`mixprec.Policy`, a built-in name (``"cpu"``, ``"cuda"``) or a
            short string (``"compute=bf16,fp32=scaled_dot_product_attention"``);
            default: the device's built-in, i.e. torch's list.

    Raises:
        RuntimeError: an unknown device type (as torch raises).
        ValueError: a bad dtype name or policy, or a dtype that conflicts with the policy's.

    Example:
        >>> import torch, mixprec
        >>> layer = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu", dtype=torch.bfloat16):
        ...     y = layer(torch.randn(2, 4))
        ...     torch.is_autocast_enabled("cpu")
        True
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
            raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
        resolved = default_policy(device_type) if policy is None else get_policy(policy, device_type)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            resolved = POLICIES.canonical(resolved)
        if dtype is not None:
            # names are parsed here; a torch.dtype goes to torch as is (it warns and disables
            # autocast for one it cannot compute in, e.g. fp32 in the `dtype=amp_dtype` pattern)
            if not isinstance(dtype, torch.dtype):
                dtype = parse_dtype(dtype, what="autocast dtype", allowed=_FLOATING)
            if resolved.compute_dtype is not None and resolved.compute_dtype is not dtype:
                raise ValueError(
                    f"dtype={dtype} conflicts with policy {resolved.name!r} whose compute dtype is "
                    f"{resolved.compute_dtype}; pass one of them"
                )
        elif resolved.compute_dtype is not None:
            dtype = resolved.compute_dtype
        self.device_type = device_type
        self.policy = resolved
        self._args = (device_type, dtype, enabled, cache_enabled, policy)
        self._torch: Any = None
        self._stack_depth = 0
        if not compiling:
            # torch validates and warns here, as it does for its own regions.
            self._torch = TorchAutocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            self.fast_dtype: torch.dtype = self._torch.fast_dtype
            self._enabled: bool = self._torch._enabled
            self._cache_enabled: bool = self._torch._cache_enabled
        else:
            self.fast_dtype = dtype if dtype is not None else torch.get_autocast_dtype(device_type)
            self._enabled = enabled
            self._cache_enabled = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
        self._entered = False

    def __enter__(self) -> autocast:
        if self._entered:
            raise RuntimeError("this mixprec.autocast object is already active; create a new one to nest")
        self._entered = True
        if torch.compiler.is_compiling():
            region.enter_traced(
                self.device_type, self.fast_dtype, self._enabled, self._cache_enabled, self.policy.compile_token
            )
            return self
        if self._torch is None:
            self._torch = TorchAutocast(
                self.device_type, dtype=self.fast_dtype, enabled=self._enabled, cache_enabled=self._cache_enabled
            )
        self._torch.__enter__()
        try:
            region.push(self.device_type, self.policy, self._torch)
        except BaseException:
            self._torch.__exit__(None, None, None)
            raise
        self._stack_depth = len(_state().module_stack)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._entered:
            raise RuntimeError("mixprec.autocast.__exit__ called without __enter__")
        self._entered = False
        if torch.compiler.is_compiling():
            region.exit_traced(self.device_type)
            return
        del _state().module_stack[self._stack_depth :]
        region.pop()
        self._torch = None  # spent: entering this object again makes a fresh one

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(
                f"autocast()(func) requires a callable, but got {type(func).__name__}. Did you mean to use "
                "autocast as a context manager? For example:\n    with mixprec.autocast(device_type=...):\n"
                "        output = model(input)"
            )
        device_type, dtype, enabled, cache_enabled, policy = self._args

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(device_type, dtype, enabled, cache_enabled, policy=policy):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


# ----- queries and the global switch ----------------------------------------------


def is_autocast_enabled(device_type: str = "cpu") -> bool:
    """Whether autocast is on for ``device_type`` in this thread (torch's state, which mixprec sets)."""
    return torch.is_autocast_enabled(device_type)


def get_autocast_dtype(device_type: str = "cpu") -> torch.dtype:
    """The autocast dtype in force for ``device_type`` (torch's state, which mixprec sets)."""
    return torch.get_autocast_dtype(device_type)


def get_autocast_policy(device_type: str = "cpu") -> Policy:
    """The policy in force for ``device_type`` (its built-in one outside mixprec regions)."""
    st = _state()
    policy = st.traced_policy.get(device_type) or st.policy.get(device_type)
    return policy if policy is not None else default_policy(device_type)


def set_autocast_enabled(
    device_type: str,
    enabled: bool,
    dtype: torch.dtype | str | None = None,
    *,
    policy: Policy | str | None = None,
    cache_enabled: bool | None = None,
) -> None:
    """Switch autocast on or off for this thread without a ``with`` block.

    Takes torch's argument order (``set_autocast_enabled("cpu", True)``); for code
    with no single entry point (MegEngine's ``amp.enabled = True``). Switching on
    opens a region (with ``dtype`` and ``policy``) that stays open until switched
    off; switching on while on replaces it. Weight casts are not cached unless
    ``cache_enabled=True`` (torch's cache lives until the region closes, so it would
    keep serving casts of weights that optimizer steps have since changed).

    Raises:
        TypeError: the arguments are in the old order (``enabled`` first).
        RuntimeError: switching while a ``with mixprec.autocast`` region opened after
            the switch is still active.
    """
    if not isinstance(device_type, str) or not isinstance(enabled, bool):
        raise TypeError(
            "set_autocast_enabled takes torch's argument order: set_autocast_enabled(device_type, enabled), "
            f"e.g. set_autocast_enabled('cpu', True); got ({device_type!r}, {enabled!r})"
        )
    st = _state()
    current = st.switched_on.get(device_type)
    if current is not None:
        region, depth = current
        if len(st.regions) != depth:
            raise RuntimeError(
                "cannot switch autocast while a `with mixprec.autocast(...)` region opened after the switch "
                "is still active; leave that region first"
            )
        del st.switched_on[device_type]
        region.__exit__(None, None, None)
    if enabled:
        # torch's weight-cast cache lives until the outermost region exits; a switch left on
        # across optimizer steps would serve casts of old weights, so it caches only if asked.
        region = autocast(device_type, dtype, True, bool(cache_enabled), policy=policy)
        region.__enter__()
        st.switched_on[device_type] = (region, len(st.regions))


# A region's entry and exit, and the rule hooks, are traced as part of the compiled code that
# calls them. Dynamo must never compile them as frames of their own (it does for functions an
# eagerly run frame calls, e.g. after it gave up on a region with a graph break inside): their
# graph would keep the entry node and run it, or bake its effect in, apart from the region.
for _func in (autocast.__init__, autocast.__enter__, autocast.__exit__):
    dispatch.never_a_frame(_func)
