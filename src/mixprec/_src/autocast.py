"""autocast: a torch.autocast region, with the policy's differences applied at the dispatcher.

``mixprec.autocast`` opens a real ``torch.autocast`` region: torch's autocast
state is set exactly as ``torch.autocast`` sets it, so torch and every library
that asks ``torch.is_autocast_enabled()`` see it, ``torch.utils.checkpoint``
replays it, and torch's own kernels cast, inside C++ composites (LSTM, einsum)
too. With a built-in policy that is all: the region is torch's, bit for bit and
at its speed.

A policy that differs from torch's list for the device (ops moved, added or
removed, an output dtype) gets kernels for the differing ops at the device's
Autocast dispatch key while the region is open (see ``mixprec._src.dispatch``).
Per-module rules switch torch's autocast dtype/enabled state, and the policy in
force, at module boundaries through global module hooks.

Nothing here syncs with the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec._src import casting, dispatch, interning
from mixprec._src.dispatch import state as _state
from mixprec._src.dtypes import parse_dtype
from mixprec._src.policy import ModuleRule, Policy
from mixprec._src.policy_grammar import default_policy, get_policy

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "autocast",
    "checkpoint_context",
    "get_autocast_dtype",
    "get_autocast_policy",
    "is_autocast_enabled",
    "set_autocast_enabled",
]

_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# torch's class, held here: code that swaps torch.autocast for mixprec's must not make it recurse.
TorchAutocast = torch.amp.autocast_mode.autocast


@functools.lru_cache(maxsize=256)
def _needs_kernels(policy: Policy, device_type: str) -> bool:
    """Whether ``policy`` differs from torch's list for ``device_type`` (module rules aside)."""
    builtin = default_policy(device_type)
    return policy.output_dtype is not None or policy.op_table != builtin.op_table


# ----- entering and leaving: plain functions, so compiled code can call them as graph nodes ----


def _push(device_type: str, policy: Policy, torch_ctx: Any, traced: bool = False) -> None:
    """Put ``policy`` in force on ``device_type``; ``torch_ctx`` is what :func:`_pop` restores of torch's."""
    st = _state()
    edited = _needs_kernels(policy, device_type)
    plan = dispatch.acquire(policy, device_type) if edited else ()
    table = st.traced_policy if traced else st.policy
    st.regions.append(
        dispatch.Region(device_type, torch_ctx, table.get(device_type), st.edited.get(device_type), plan, traced)
    )
    table[device_type] = policy
    if edited:
        st.edited[device_type] = policy
    else:
        st.edited.pop(device_type, None)
    if policy.module_rules:
        _count_rule_user(st, +1)


def _pop() -> None:
    st = _state()
    region = st.regions.pop()
    device_type, torch_ctx = region.device_type, region.torch_state
    policies = st.traced_policy if region.traced else st.policy
    if policies[device_type].module_rules:
        _count_rule_user(st, -1)
    for table, prev in ((policies, region.prev_policy), (st.edited, region.prev_edited)):
        if prev is None:
            table.pop(device_type, None)
        else:
            table[device_type] = prev
    dispatch.release(region.plan)
    if not st.regions:
        st.cache.clear()
        st.module_stack.clear()
    if isinstance(torch_ctx, tuple):  # a kept module: torch's state outside it
        torch.set_autocast_enabled(device_type, torch_ctx[0])
        torch.set_autocast_dtype(device_type, torch_ctx[1])
    elif torch_ctx is not None:
        torch_ctx.__exit__(None, None, None)


def _unwind_on_failed_trace(depth: int) -> None:
    """While Dynamo traces, close what a trace that stops early would leave open."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no Dynamo trace in this thread
        tx = None
    if tx is None:  # AOTAutograd's trace: it runs the whole graph, exits included
        return
    tx.output.add_cleanup_hook(functools.partial(_pop_to, depth))


def _pop_to(depth: int) -> None:
    """Close the regions opened after the stack was ``depth`` deep."""
    while len(_state().regions) > depth:
        _pop()


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _enter_traced(device_type: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool, token: str) -> None:
    # Under torch.compile this is a node of the graph: Dynamo and AOTAutograd run it while
    # tracing (so the ops traced after it see the region), compiled code no longer needs it.
    _unwind_on_failed_trace(len(_state().regions))
    torch_ctx = torch.amp.autocast_mode._UnmanagedAutocast(device_type, dtype, enabled, cache_enabled)
    torch_ctx.__enter__()  # type: ignore[no-untyped-call]
    _push(device_type, interning.policy_for(token), torch_ctx, traced=True)


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _exit_traced(device_type: str) -> None:
    _pop()


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
            resolved = interning.canonical(resolved)
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
        # A module whose forward this region runs inside (set by mixprec.prepare): modules called
        # in the region are named from it, as when the region encloses the module's call.
        self._naming_root: nn.Module | None = None
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
            _enter_traced(
                self.device_type, self.fast_dtype, self._enabled, self._cache_enabled, self.policy.compile_token
            )
            return self
        if self._torch is None:
            self._torch = TorchAutocast(
                self.device_type, dtype=self.fast_dtype, enabled=self._enabled, cache_enabled=self._cache_enabled
            )
        self._torch.__enter__()
        try:
            _push(self.device_type, self.policy, self._torch)
        except BaseException:
            self._torch.__exit__(None, None, None)
            raise
        st = _state()
        self._stack_depth = len(st.module_stack)
        if self._naming_root is not None and not st.module_stack:
            st.module_stack.append((self._naming_root, "", ()))
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._entered:
            raise RuntimeError("mixprec.autocast.__exit__ called without __enter__")
        self._entered = False
        if torch.compiler.is_compiling():
            _exit_traced(self.device_type)
            return
        del _state().module_stack[self._stack_depth :]
        _pop()
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


# ----- checkpointing -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a replay needs of mixprec's state: the policies in force that differ from torch's
    lists, per device, and the module the code runs in (its children are named from it)."""

    policies: dict[str, Policy]
    module: tuple[Any, str] | None


def snapshot() -> Snapshot:
    st = _state()
    policies = {d: p for d, p in st.policy.items() if p.module_rules or _needs_kernels(p, d)}
    module = (st.module_stack[-1][0], st.module_stack[-1][1]) if st.module_stack and policies else None
    return Snapshot(policies, module)


@contextlib.contextmanager
def _capture() -> Iterator[None]:
    st = _state()
    st.captured += 1
    try:
        yield
    finally:
        st.captured -= 1


@contextlib.contextmanager
def replay(snapshot: Snapshot) -> Iterator[None]:
    """Put a snapshot's policies back in force; torch's own autocast state is replayed by the caller."""
    st = _state()
    depth, stack_depth = len(st.regions), len(st.module_stack)
    st.captured += 1
    try:
        for device_type, policy in snapshot.policies.items():
            _push(device_type, policy, None)
        if snapshot.module is not None:  # modules called in the replay are named from here
            st.module_stack.append((*snapshot.module, ()))
        yield
    finally:
        del st.module_stack[stack_depth:]
        _pop_to(depth)
        st.captured -= 1


def checkpoint_context(
    inner: Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]
    | None = None,
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that replays the mixprec policy in its recompute.

    torch's checkpoint replays torch's autocast state (enabled, dtype) but knows
    nothing of a mixprec policy's edited ops or module rules. Pass this function
    as ``checkpoint(fn, *args, use_reentrant=False, context_fn=mixprec.checkpoint_context)``
    (Hugging Face: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs=
    {"use_reentrant": False, "context_fn": mixprec.checkpoint_context})``, before transformers 5
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``). Without it, checkpointing a
    region whose policy differs from torch's raises instead of computing other
    gradients. With a built-in policy it is not needed (and harmless). To combine it with
    another ``context_fn`` (selective checkpointing), pass that one as ``inner``:
    ``context_fn=functools.partial(mixprec.checkpoint_context, inner=other_context_fn)``.

    Example:
        >>> import torch, mixprec
        >>> from torch.utils.checkpoint import checkpoint
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> policy = mixprec.get_policy("cpu").keep_modules(torch.nn.LayerNorm)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     y = checkpoint(net, x, use_reentrant=False, context_fn=mixprec.checkpoint_context)
        >>> y.float().sum().backward()
    """
    if inner is None:
        return _capture(), replay(snapshot())
    forward, recompute = inner()
    return _both(_capture(), forward), _both(replay(snapshot()), recompute)


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[Any], second: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    with first, second:
        yield


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


def _count_rule_user(st: dispatch.ThreadState, delta: int) -> None:
    """A region with rules opens (+1) or closes (-1); the first installs the hooks, the last removes them."""
    global _hook_users
    st.rule_users += delta
    with _hooks_lock:
        _hook_users += delta
        if delta > 0 and _HOOK_KEY not in _module._global_forward_pre_hooks:
            _module._global_forward_pre_hooks[_HOOK_KEY] = _pre_hook
            _module._global_forward_hooks[_HOOK_KEY] = _post_hook
            _module._global_forward_hooks_always_called[_HOOK_KEY] = True
        # While compiling, the hooks stay (the compiled frame's guards read them after tracing);
        # they do nothing while no region with rules is open, and the next eager exit removes them.
        elif delta < 0 and _hook_users == 0 and not torch.compiler.is_compiling():
            del _module._global_forward_pre_hooks[_HOOK_KEY]
            del _module._global_forward_hooks[_HOOK_KEY]
            del _module._global_forward_hooks_always_called[_HOOK_KEY]


def _qualified_name(st: dispatch.ThreadState, module: nn.Module) -> str:
    if not st.module_stack:
        return ""
    parent, parent_name, _ = st.module_stack[-1]
    if isinstance(parent, _CompiledWrapper):  # torch.compile's wrapper runs only its _orig_mod: same name
        return str(parent_name)
    compiling = torch.compiler.is_compiling()  # then names are worked out once, at trace time
    # Names are cached per parent and the parent's name: a module reached from another root
    # (a submodule called on its own) has another qualified name.
    names = None if compiling else st.module_names.setdefault(parent, {})
    key = (parent_name, id(module))
    name = None if names is None else names.get(key)
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
    if names is not None:
        names[key] = name
    return name


def _match_rule(rules: tuple[ModuleRule, ...], module: nn.Module, name: str) -> ModuleRule | None:
    for rule in rules:
        if rule.matches(module, name):
            return rule
    return None


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _rule_enter(device_type: str, dtype: torch.dtype) -> None:
    """Enter a kept module: autocast off (fp32) or on in ``dtype``, the policy without rules."""
    st = _state()
    policy = st.traced_policy.get(device_type) or st.policy[device_type]
    dispatch.check_checkpoint(st)
    if torch.compiler.is_compiling():
        _unwind_on_failed_trace(len(st.regions))
    outside = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    if dtype is torch.float32:
        torch.set_autocast_enabled(device_type, False)
    else:
        torch.set_autocast_enabled(device_type, True)
        torch.set_autocast_dtype(device_type, dtype)
    _push(device_type, policy.without_rules, outside, traced=torch.compiler.is_compiling())


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _rule_exit(device_type: str) -> None:
    _pop()


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_policy_tokens() -> tuple[tuple[str, str], ...]:
    # Constant-folded while Dynamo traces: the regions it names were opened by the traced
    # code itself (their policies are arguments of its graph nodes, so already guarded).
    return tuple((d, p.compile_token) for d, p in _state().traced_policy.items())


def _policies_in_force(st: dispatch.ThreadState) -> dict[str, Policy]:
    if not torch.compiler.is_compiling():
        return st.policy
    return {**st.policy, **{d: interning.policy_for(token) for d, token in _traced_policy_tokens()}}


def _pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    st = _state()
    if not torch.compiler.is_compiling() and st.rule_users == 0:
        return None
    in_force = _policies_in_force(st)
    if not any(p.module_rules for p in in_force.values()):
        return None
    name = _qualified_name(st, module)
    if isinstance(module, _OptimizedModule):
        # torch.compile's wrapper: its _orig_mod runs the hooks again and takes this name,
        # found here, eagerly. The stack holds a stand-in: Dynamo must not reach the
        # module it traces through another path.
        st.module_stack.append((_CompiledWrapper(id(module)), name, None))
        return None
    entered: list[str] = []
    new_args = None
    for device_type, policy in in_force.items():
        if not policy.module_rules or not torch.is_autocast_enabled(device_type):
            continue
        rule = _match_rule(policy.module_rules, module, name)
        if rule is None:
            continue
        _rule_enter(device_type, rule.dtype)
        entered.append(device_type)
        new_args = casting.cast_floating(args if new_args is None else new_args, rule.dtype, device_type)
    st.module_stack.append((module, name, tuple(entered)))
    return new_args


def _post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    st = _state()
    if not st.module_stack:
        return
    top = st.module_stack[-1][0]
    if top is not module and not (isinstance(top, _CompiledWrapper) and top.ident == id(module)):
        return
    _, _, entered = st.module_stack.pop()
    for device_type in reversed(entered or ()):
        _rule_exit(device_type)


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
for _func in (autocast.__init__, autocast.__enter__, autocast.__exit__, _pre_hook, _post_hook):
    dispatch.never_a_frame(_func)
