"""Precision policies: which ops run in low precision, which in fp32, as data.

A :class:`Policy` is a frozen value. It holds the op categories torch.autocast
uses (run in low precision, run in fp32, run in fp32 through the op's ``dtype``
argument, promote to the widest input, banned), the compute dtype, an optional
output dtype for low-precision ops, and per-module rules. Change it with
:meth:`Policy.add`, :meth:`Policy.remove`, :meth:`Policy.keep_modules` or
``dataclasses.replace``; each returns a new policy.

Example:
    >>> import torch, mixprec
    >>> policy = mixprec.get_policy("cpu").add("fp32", torch.Tensor.exp, torch.exp)
    >>> policy.category_of(torch.exp)
    <OpCategory.FP32: 'fp32'>
    >>> mixprec.get_policy("compute=bf16,output=fp32").output_dtype
    torch.float32
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from mixprec import _op_tables as tables
from mixprec._dtypes import NamedEnum, parse_dtype, short_name

_WRAPPERS = tables.wrappers()

Op = Callable[..., Any]


def _expand(op: Op) -> tuple[Op, ...]:
    """All forms of ``op`` a TorchFunctionMode can receive.

    A ``torch.library.custom_op`` arrives as its OpOverload; ``torch.ops.ns.op(...)``
    as the OpOverloadPacket, ``torch.ops.ns.op.default(...)`` as the OpOverload.
    """
    overload = getattr(op, "_opoverload", None)  # a torch.library.CustomOpDef
    if isinstance(overload, torch._ops.OpOverload):
        op = overload
    if isinstance(op, torch._ops.OpOverload):
        packet = op.overloadpacket
        return (op, packet, *(getattr(packet, name) for name in packet.overloads()))  # type: ignore[no-untyped-call]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return (op, *(getattr(op, name) for name in op.overloads()))  # type: ignore[no-untyped-call]
    return (op,)


def _expand_all(ops: Iterable[Op]) -> frozenset[Op]:
    return frozenset(form for op in ops for form in _expand(op))


class OpCategory(NamedEnum):
    """What autocast does with an op; torch's CastPolicy, by name."""

    #: Cast floating inputs to the compute dtype (matmuls, convolutions).
    LOWER = "lower"
    #: Cast floating inputs to fp32 (losses, reductions, linear algebra).
    FP32 = "fp32"
    #: Pass ``dtype=torch.float32`` unless the caller gave one (softmax, sum on CUDA).
    FP32_SET_DTYPE = "fp32_set_dtype"
    #: Cast to the widest floating input: fp32 if any input is fp32 (cat, stack).
    PROMOTE = "promote"
    #: Raise an error that says what to use instead.
    BANNED = "banned"

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "op category", "categories"


#: Norm layers, the usual modules to keep in fp32.
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """Run matching modules in ``dtype``, with floating inputs cast at the module boundary.

    A module matches when it is an instance of one of ``types`` or its qualified
    name (as in ``model.named_modules()``) matches one of the glob ``names``
    (``"head"``, ``"blocks.*.norm1"``). With ``dtype=torch.float32`` autocast is
    off inside the module; with a low dtype the module runs under the policy
    with that compute dtype.
    """

    types: tuple[type[nn.Module], ...] = ()
    names: tuple[str, ...] = ()
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        # One type or one pattern may be given bare: types=nn.LayerNorm, names="head".
        types, names = self.types, self.names
        object.__setattr__(self, "types", (types,) if isinstance(types, type) else tuple(types))
        object.__setattr__(self, "names", (names,) if isinstance(names, str) else tuple(names))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype, what="module rule dtype"))
        for t in self.types:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise TypeError(f"ModuleRule.types takes nn.Module subclasses, got {t!r}")
        if not self.types and not self.names:
            raise ValueError("a ModuleRule needs types=(SomeModule, ...) or names=('pattern', ...)")

    def matches(self, module: nn.Module, name: str) -> bool:
        """Whether this rule applies to ``module`` called under qualified ``name``."""
        return isinstance(module, self.types) or (bool(self.names) and _name_matches(self.names, name))


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]  # Dynamo cannot trace fnmatch's re
def _name_matches(patterns: tuple[str, ...], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)  # fnmatch caches compiled patterns


@dataclasses.dataclass(frozen=True, eq=True)
class Policy:
    """A precision policy; see the module docstring.

    Attributes:
        lower: ops run in ``compute_dtype``.
        fp32: ops run in fp32.
        fp32_set_dtype: ops run in fp32 by passing ``dtype=torch.float32``.
        promote: ops run in the widest floating input dtype.
        banned: op -> message saying what to use instead.
        compute_dtype: the low precision; ``None`` takes autocast's ``dtype`` argument.
        output_dtype: if set, floating outputs of ``lower`` ops are cast to it.
        module_rules: per-module precision, first match wins.
        name: a label for reports; not compared.
    """

    lower: frozenset[Op] = frozenset()
    fp32: frozenset[Op] = frozenset()
    fp32_set_dtype: frozenset[Op] = frozenset()
    promote: frozenset[Op] = frozenset()
    banned: Mapping[Op, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    compute_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    module_rules: tuple[ModuleRule, ...] = ()
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for field in ("lower", "fp32", "fp32_set_dtype", "promote"):
            ops = frozenset(getattr(self, field))
            for op in ops:
                if not callable(op):
                    raise TypeError(f"Policy.{field} holds callables, got {op!r}")
            object.__setattr__(self, field, _expand_all(ops))
        banned = {form: text for op, text in dict(self.banned).items() for form in _expand(op)}
        object.__setattr__(self, "banned", MappingProxyType(banned))
        object.__setattr__(self, "module_rules", tuple(self.module_rules))
        if self.compute_dtype is not None:
            object.__setattr__(self, "compute_dtype", parse_dtype(self.compute_dtype, what="compute dtype"))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", parse_dtype(self.output_dtype, what="output dtype"))
        table: dict[Op, OpCategory] = {}
        for category in OpCategory:
            for op in self.ops(category):
                if op in table:
                    raise ValueError(
                        f"{_op_name(op)} is in both {table[op].value!r} and {category.value!r}; an op has one category"
                    )
                table[op] = category
        object.__setattr__(self, "_table", table)
        # The policy inside a kept module, made once here rather than on every module call.
        without_rules = dataclasses.replace(self, module_rules=()) if self.module_rules else self
        object.__setattr__(self, "_without_rules", without_rules)
        # The lookup autocast does once per torch call; not a field, so not compared or hashed.
        object.__setattr__(self, "_dispatch", _dispatch_table(table))

        object.__setattr__(self, "_hash", hash((self.lower, self.fp32, self.fp32_set_dtype, self.promote,
                                                frozenset(self.banned.items()), self.compute_dtype,
                                                self.output_dtype, self.module_rules)))  # fmt: skip

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined,no-any-return]

    def ops(self, category: OpCategory | str) -> frozenset[Op]:
        """The ops of one category."""
        category = OpCategory.from_name(category)
        if category is OpCategory.BANNED:
            return frozenset(self.banned)
        return getattr(self, category.value)  # type: ignore[no-any-return]

    def category_of(self, op: Op) -> OpCategory | None:
        """The category ``op`` is in, or ``None`` if autocast leaves it alone."""
        return self._table.get(_expand(op)[0])  # type: ignore[attr-defined,no-any-return]

    def add(self, category: OpCategory | str, *ops: Op, hint: str | None = None) -> Policy:
        """A copy with ``ops`` moved into ``category`` (out of any other).

        ``ops`` may be torch functions, Tensor methods, custom ops
        (``torch.ops.mylib.op``) or any function of the user's that takes tensors;
        a user function is seen only if it dispatches ``__torch_function__``,
        so wrap plain Python functions with :func:`mixprec.op`. ``hint`` is the
        error text for banned ops.
        """
        category = OpCategory.from_name(category)
        if not ops:
            raise ValueError("Policy.add needs at least one op")
        for op in ops:
            if not callable(op):
                raise TypeError(f"Policy.add takes callables, got {op!r}")
        base = self.remove(*ops, missing_ok=True)
        if category is OpCategory.BANNED:
            text = hint or "this op is banned by the active mixprec policy"
            return dataclasses.replace(base, banned={**base.banned, **{op: text for op in ops}})
        changes: dict[str, Any] = {category.value: base.ops(category) | set(ops)}
        return dataclasses.replace(base, **changes)

    def remove(self, *ops: Op, missing_ok: bool = False) -> Policy:
        """A copy where autocast leaves ``ops`` alone.

        Raises:
            ValueError: an op is in no category (unless ``missing_ok``).
        """
        if not missing_ok:
            for op in ops:
                if self.category_of(op) is None:
                    raise ValueError(f"{_op_name(op)} is in no category of policy {self.name!r}; nothing to remove")
        drop = _expand_all(ops)
        return dataclasses.replace(
            self,
            lower=self.lower - drop,
            fp32=self.fp32 - drop,
            fp32_set_dtype=self.fp32_set_dtype - drop,
            promote=self.promote - drop,
            banned={op: text for op, text in self.banned.items() if op not in drop},
        )

    def keep_modules(
        self,
        types: type[nn.Module] | Iterable[type[nn.Module]] = (),
        names: str | Iterable[str] = (),
        dtype: torch.dtype | str = torch.float32,
    ) -> Policy:
        """A copy with one more :class:`ModuleRule` (e.g. norm layers and the head in fp32).

        ``types`` and ``names`` take one item or several: ``keep_modules(nn.LayerNorm)``,
        ``keep_modules(names=("head", "blocks.*.attn"))``.
        """
        rule = ModuleRule(types=types, names=names, dtype=parse_dtype(dtype, what="module rule dtype"))  # type: ignore[arg-type]
        return dataclasses.replace(self, module_rules=(*self.module_rules, rule))

    def describe(self) -> str:
        """A readable summary: dtypes, then each category's ops by name."""
        lines = [
            f"Policy {self.name!r}: compute={short_name(self.compute_dtype)} output={short_name(self.output_dtype)}"
        ]
        for category in OpCategory:
            names = sorted({_op_name(op) for op in self.ops(category)})
            lines.append(f"  {category.value} ({len(names)}): {', '.join(names)}")
        for rule in self.module_rules:
            types = ", ".join(t.__name__ for t in rule.types)
            lines.append(f"  module rule: types=[{types}] names={list(rule.names)} -> {short_name(rule.dtype)}")
        return "\n".join(lines)


#: Dispatch code for a Python wrapper whose builtins are all unlisted: call it as is.
PASS_THROUGH = "pass"


def _dispatch_table(table: dict[Op, OpCategory]) -> dict[Op, OpCategory | str]:
    dispatch: dict[Op, OpCategory | str] = {}
    for wrapper, reach in _WRAPPERS.items():
        if wrapper in table:
            continue
        listed = {table[op] for op in reach if op in table}
        if not listed:
            dispatch[wrapper] = PASS_THROUGH
        elif len(listed) == 1 and listed != {OpCategory.PROMOTE}:
            dispatch[wrapper] = listed.pop()
    dispatch.update(table)
    return dispatch


def _op_name(op: Op) -> str:
    owner = getattr(op, "__objclass__", None) or getattr(op, "__self__", None)
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)
    if isinstance(owner, type) and not name.startswith(owner.__name__):
        return f"{owner.__name__}.{name}"
    return str(name)


def _builtin(name: str) -> Policy:
    if name == "cpu":
        return Policy(
            lower=tables.resolve(tables.CPU_LOWER + tables.CPU_LOWER_COMPOSITES),
            fp32=tables.resolve(tables.CPU_FP32 + tables.CPU_FP32_COMPOSITES),
            promote=tables.resolve(tables.CPU_PROMOTE + tables.PROMOTE_COMPOSITES),
            name="cpu",
        )
    lower = tables.resolve(tables.CUDA_LOWER)
    return Policy(
        lower=lower,
        fp32=tables.resolve(tables.CUDA_FP32 + tables.CUDA_FP32_COMPOSITES) - lower,
        fp32_set_dtype=tables.resolve(tables.CUDA_FP32_SET_DTYPE),
        promote=tables.resolve(tables.CUDA_PROMOTE + tables.PROMOTE_COMPOSITES) - lower,
        banned={op: hint for name, hint in tables.CUDA_BANNED.items() for op in tables.entry_points(name)},
        name="cuda",
    )


_DEVICE_POLICY = {"cpu": "cpu", "cuda": "cuda", "xpu": "cuda", "mps": "cuda", "hpu": "cpu", "xla": "cpu"}
# Built at import: cheap (a few hundred getattrs), and never inside a torch.compile trace.
_BUILTINS: dict[str, Policy] = {name: _builtin(name) for name in ("cpu", "cuda")}


def builtin_policy(name: str) -> Policy:
    """torch's own lists for ``"cpu"`` or ``"cuda"`` (any policy may be used on any device)."""
    policy = _BUILTINS.get(name)
    if policy is None:
        raise ValueError(f"unknown policy {name!r}; built-in policies: {', '.join(_BUILTINS)}")
    return policy


def default_policy(device_type: str) -> Policy:
    """The built-in policy autocast uses on ``device_type`` when none is given."""
    return builtin_policy(_DEVICE_POLICY.get(device_type, "cuda"))


_KEYS = ("base", "compute", "output", "keep")


_PARSED: dict[tuple[str, str], Policy] = {}
_CANONICAL: dict[Policy, Policy] = {}


def canonical(policy: Policy) -> Policy:
    """The first-seen policy equal to ``policy``.

    torch.compile guards on the policy object a graph was traced with; handing it
    one object per distinct policy lets a policy rebuilt every step
    (``get_policy("cpu").keep_modules(...)`` inside the loop) reuse the graph.
    """
    found = _CANONICAL.get(policy)
    if found is None:
        if len(_CANONICAL) >= 1024:  # a program building endless distinct policies: do not grow forever
            _CANONICAL.clear()
        found = _CANONICAL[policy] = policy
    return found


def get_policy(spec: str | Policy, device_type: str = "cpu") -> Policy:
    """A policy from a name (``"cpu"``), a short string, or a Policy (returned as is).

    The string is comma-separated ``key=value`` pairs:

    * ``base=cpu|cuda``: the op lists (default: ``device_type``'s);
    * ``compute=bf16|fp16``: the compute dtype;
    * ``output=fp32|bf16|fp16``: cast low-precision op outputs to this;
    * ``keep=norm``: keep norm layers in fp32.

    Raises:
        ValueError: unknown key, policy name or dtype name; the message lists valid ones.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"policy must be a mixprec.Policy or a string such as 'compute=bf16', got {type(spec).__name__}"
        )
    builtin = _BUILTINS.get(spec)
    if builtin is not None:  # the one path torch.compile traces: a lookup it can follow
        return builtin
    # Policies are frozen values: parse a string once (about 160 us), then reuse the result.
    key = (spec, device_type)
    cached = _PARSED.get(key)
    if cached is None:
        cached = _PARSED[key] = _parse(spec, device_type)
    return cached


def _parse(spec: str, device_type: str) -> Policy:
    text = spec.strip()
    if "=" not in text:
        return builtin_policy(text)
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _KEYS:
            raise ValueError(f"bad policy field {part!r} in {spec!r}; valid keys: {', '.join(_KEYS)} (as key=value)")
        fields[key] = value
    policy = builtin_policy(fields["base"]) if "base" in fields else default_policy(device_type)
    changes: dict[str, Any] = {"name": text}
    if "compute" in fields:
        changes["compute_dtype"] = parse_dtype(
            fields["compute"], what="compute dtype", allowed=(torch.bfloat16, torch.float16)
        )
    if "output" in fields:
        changes["output_dtype"] = parse_dtype(fields["output"], what="output dtype")
    policy = dataclasses.replace(policy, **changes)
    if "keep" in fields:
        if fields["keep"] != "norm":
            raise ValueError(f"unknown keep={fields['keep']!r}; valid: keep=norm (keeps norm layers in fp32)")
        policy = policy.keep_modules(types=NORM_TYPES)
    return policy
