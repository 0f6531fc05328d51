"""Precision policies: which ops run in low precision, which in fp32, as data.

A :class:`Policy` is a frozen value. It holds the op categories torch.autocast
uses (run in low precision, run in fp32, run in fp32 through the op's ``dtype``
argument, promote to the widest input, banned), the compute dtype, an optional
output dtype for low-precision ops, and per-module rules. Change it with
:meth:`Policy.add`, :meth:`Policy.remove`, :meth:`Policy.keep_modules` or
``dataclasses.replace``; each returns a new policy.

Ops are named as torch's own autocast lists name them (ATen names). A policy
equal to torch's list for a device costs nothing: autocast is then torch's.

Example:
    >>> import torch, mixprec
    >>> policy = mixprec.get_policy("cpu").add("fp32", "exp").add("fp32", torch.nn.functional.softmax)
    >>> policy.category_of(torch.exp), sorted(policy.fp32 - mixprec.get_policy("cpu").fp32)
    (<OpCategory.FP32: 'fp32'>, ['exp', 'softmax'])
    >>> mixprec.get_policy("compute=bf16,output=fp32").output_dtype
    torch.float32
"""

from __future__ import annotations

import dataclasses
import fnmatch
import textwrap
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from mixprec import _op_tables as tables
from mixprec._dtypes import NamedEnum, parse_dtype, short_name

Op = str | Callable[..., Any]

# Python functions in torch whose ATen op has another name.
_ALIASES = {"cross_entropy": "cross_entropy_loss", "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow",
            "__rpow__": "pow", "__rsub__": "rsub"}  # fmt: skip
#: Names of Python functions made visible to policies by :func:`mixprec.op`.
PYTHON_OPS: dict[str, Callable[..., Any]] = {}


_TOKENS: dict[Policy, str] = {}
_BY_TOKEN: dict[str, Policy] = {}


def op_name(op: Op) -> str:
    """The name a policy uses for ``op``: ``"mm"`` for ATen ops, ``"ns::name"`` for custom ops.

    Takes a name (``"mm"``, ``"aten::mm"``, ``"mylib::scale"``), a torch callable
    (``torch.mm``, ``torch.Tensor.mm``, ``F.linear``, ``F.mse_loss``), an OpOverload
    or OpOverloadPacket (``torch.ops.aten.mm``), a ``torch.library.custom_op``, or a
    function wrapped with :func:`mixprec.op`.

    Raises:
        ValueError: no such op; the message names the closest ones.
        TypeError: a callable that is not an op (wrap plain Python functions with ``mixprec.op``).
    """
    if isinstance(op, str):
        return _checked_name(op)
    name = getattr(op, "__mixprec_op__", None)
    if isinstance(name, str):
        return name
    overload = getattr(op, "_opoverload", None)  # a torch.library.CustomOpDef
    if isinstance(overload, torch._ops.OpOverload):
        op = overload
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _checked_name(op._qualified_op_name)
    func_name = getattr(op, "__name__", None)
    module = getattr(op, "__module__", None) or ""
    owner = getattr(op, "__objclass__", None) or getattr(op, "__self__", None)
    from_torch = (
        module.startswith("torch")
        or (isinstance(owner, type) and issubclass(owner, torch._C.TensorBase))
        or isinstance(owner, type(torch._C))
    )
    if isinstance(func_name, str) and from_torch:
        candidate = _ALIASES.get(func_name, func_name)
        if _aten_exists(candidate):
            return candidate
    raise TypeError(
        f"{op!r} is not a torch op a policy can list; name the ATen op it runs (e.g. 'mm'), "
        "or decorate your own function with @mixprec.op"
    )


def _aten_exists(name: str) -> bool:
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _checked_name(text: str) -> str:
    name = text.strip()
    namespace, sep, short = name.rpartition("::")
    if not sep or namespace == "aten":
        if _aten_exists(short):
            return short
        raise ValueError(f"unknown op {text!r}{_suggest(short)}; policies name ATen ops as torch's lists do ('mm')")
    if name in PYTHON_OPS:
        return name
    try:
        getattr(getattr(torch.ops, namespace), short)
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"unknown op {text!r}: no operator {short!r} is registered in namespace {namespace!r}"
        ) from None
    return name


def _suggest(name: str) -> str:
    import difflib

    known = sorted(
        {n[len("aten::") :].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    )
    close = difflib.get_close_matches(name, known, n=3)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _names(ops: Iterable[Op]) -> frozenset[str]:
    return frozenset(op_name(op) for op in ops)


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

    def describe(self) -> str:
        """One line: what matches and the dtype, e.g. ``LayerNorm, 'head' -> fp32``."""
        what = [t.__name__ for t in self.types] + [repr(n) for n in self.names]
        return f"{', '.join(what)} -> {short_name(self.dtype)}"


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]  # Dynamo cannot trace fnmatch's re
def _name_matches(patterns: tuple[str, ...], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)  # fnmatch caches compiled patterns


@dataclasses.dataclass(frozen=True, eq=True)
class Policy:
    """A precision policy; see the module docstring.

    Ops are named as torch's autocast lists name them (ATen names: ``"mm"``,
    ``"conv2d"``, ``"scaled_dot_product_attention"``); every method also takes
    torch callables (``torch.mm``, ``F.linear``), custom ops and :func:`mixprec.op`
    functions and stores their names.

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

    lower: frozenset[str] = frozenset()
    fp32: frozenset[str] = frozenset()
    fp32_set_dtype: frozenset[str] = frozenset()
    promote: frozenset[str] = frozenset()
    banned: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    compute_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    module_rules: tuple[ModuleRule, ...] = ()
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for field in ("lower", "fp32", "fp32_set_dtype", "promote"):
            ops = getattr(self, field)
            if isinstance(ops, str) or callable(ops):
                raise TypeError(f"Policy.{field} takes a collection of ops, got the single op {ops!r}")
            object.__setattr__(self, field, _names(ops))
        banned = {op_name(op): text for op, text in dict(self.banned).items()}
        object.__setattr__(self, "banned", MappingProxyType(banned))
        object.__setattr__(self, "module_rules", tuple(self.module_rules))
        if self.compute_dtype is not None:
            object.__setattr__(self, "compute_dtype", parse_dtype(self.compute_dtype, what="compute dtype"))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", parse_dtype(self.output_dtype, what="output dtype"))
        table: dict[str, OpCategory] = {}
        for category in OpCategory:
            for name in self.ops(category):
                if name in table:
                    raise ValueError(
                        f"{name} is in both {table[name].value!r} and {category.value!r}; an op has one category"
                    )
                table[name] = category
        object.__setattr__(self, "_table", table)
        # The policy inside a kept module, made once here rather than on every module call.
        without_rules = dataclasses.replace(self, module_rules=()) if self.module_rules else self
        object.__setattr__(self, "_without_rules", without_rules)
        object.__setattr__(self, "_hash", hash((self.lower, self.fp32, self.fp32_set_dtype, self.promote,
                                                frozenset(self.banned.items()), self.compute_dtype,
                                                self.output_dtype, self.module_rules)))  # fmt: skip
        # Equal policies share one small int: compiled code names a policy by it (a graph constant).
        # A string, not an int: Dynamo would make an int that changes between calls a symbolic size.
        object.__setattr__(self, "_token", _TOKENS.setdefault(self, f"policy{len(_TOKENS)}"))
        _BY_TOKEN.setdefault(self._token, self)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined,no-any-return]

    def __repr__(self) -> str:
        """One line: the built-in lists it starts from and what it changes, e.g.
        ``Policy(cuda +fp32[scaled_dot_product_attention] compute=bf16 rules[LayerNorm -> fp32])``."""
        parts = [self.edits()]
        if self.compute_dtype is not None:
            parts.append(f"compute={short_name(self.compute_dtype)}")
        if self.output_dtype is not None:
            parts.append(f"output={short_name(self.output_dtype)}")
        if self.module_rules:
            parts.append(f"rules[{'; '.join(rule.describe() for rule in self.module_rules)}]")
        return f"Policy({' '.join(parts)})"

    def edits(self) -> str:
        """The op lists as a built-in name plus moves, e.g. ``cpu +fp32[exp] -lower[mm]``."""
        table: dict[str, OpCategory] = self._table  # type: ignore[attr-defined]

        def moves(base: Policy) -> list[str]:
            other: dict[str, OpCategory] = base._table  # type: ignore[attr-defined]
            out = []
            for category in OpCategory:
                added = sorted(n for n, c in table.items() if c is category and other.get(n) is not category)
                if added:
                    out.append(f"+{category.value}[{', '.join(added)}]")
            dropped = sorted(n for n in other if n not in table)
            if dropped:
                out.append(f"-[{', '.join(dropped)}]")
            return out

        name, found = min(((n, moves(p)) for n, p in _BUILTINS.items()), key=lambda item: len(" ".join(item[1])))
        return " ".join([name, *found])

    def ops(self, category: OpCategory | str) -> frozenset[str]:
        """The names of the ops of one category."""
        category = OpCategory.from_name(category)
        if category is OpCategory.BANNED:
            return frozenset(self.banned)
        return getattr(self, category.value)  # type: ignore[no-any-return]

    def category_of(self, op: Op) -> OpCategory | None:
        """The category ``op`` is in, or ``None`` if autocast leaves it alone."""
        return self._table.get(op_name(op))  # type: ignore[attr-defined,no-any-return]

    def add(self, category: OpCategory | str, *ops: Op, hint: str | None = None) -> Policy:
        """A copy with ``ops`` moved into ``category`` (out of any other).

        ``ops`` are ATen names (``"exp"``), torch callables (``torch.exp``), custom
        ops (``torch.ops.mylib.op``) or functions wrapped with :func:`mixprec.op`.
        ``hint`` is the error text for banned ops.
        """
        category = OpCategory.from_name(category)
        if not ops:
            raise ValueError("Policy.add needs at least one op")
        names = _names(ops)
        base = self.remove(*names, missing_ok=True)
        if category is OpCategory.BANNED:
            text = hint or "this op is banned by the active mixprec policy"
            return dataclasses.replace(base, banned={**base.banned, **{name: text for name in names}})
        changes: dict[str, Any] = {category.value: base.ops(category) | names}
        return dataclasses.replace(base, **changes)

    def remove(self, *ops: Op, missing_ok: bool = False) -> Policy:
        """A copy where autocast leaves ``ops`` alone.

        Raises:
            ValueError: an op is in no category (unless ``missing_ok``).
        """
        drop = _names(ops)
        if not missing_ok:
            for name in sorted(drop):
                if name not in self._table:  # type: ignore[attr-defined]
                    raise ValueError(f"{name} is in no category of policy {self.name!r}; nothing to remove")
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

    def describe(self, width: int = 100) -> str:
        """A readable summary: dtypes, each category's ops by name, then the module rules."""
        lines = [
            f"Policy {self.name!r}: compute={short_name(self.compute_dtype)} output={short_name(self.output_dtype)}"
        ]
        for category in OpCategory:
            names = sorted(self.ops(category))
            head = f"  {category.value} ({len(names)}): "
            text = ", ".join(names) if names else "-"
            lines += textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * 4) or [head]
        for rule in self.module_rules:
            lines.append(f"  module rule: {rule.describe()}")
        return "\n".join(lines)


def _builtin(name: str) -> Policy:
    if name == "cpu":
        return Policy(
            lower=frozenset(tables.CPU_LOWER),
            fp32=frozenset(tables.CPU_FP32),
            promote=frozenset(tables.CPU_PROMOTE),
            name="cpu",
        )
    return Policy(
        lower=frozenset(tables.CUDA_LOWER),
        fp32=frozenset(tables.CUDA_FP32),
        fp32_set_dtype=frozenset(tables.CUDA_FP32_SET_DTYPE),
        promote=frozenset(tables.CUDA_PROMOTE),
        banned=tables.CUDA_BANNED,
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


_OP_KEYS = ("lower", "fp32", "fp32_set_dtype", "promote", "none")
_KEYS = ("base", "compute", "output", "keep", *_OP_KEYS)
_SYNTAX = (
    "a policy string is a built-in name (cpu, cuda) or comma-separated key=value pairs: base=cpu|cuda, "
    "compute=bf16|fp16, output=fp32|bf16|fp16, keep=norm, and op moves such as fp32=exp+softmax or "
    "none=mm (ATen names joined by '+'); e.g. 'base=cpu,compute=bf16,fp32=scaled_dot_product_attention'"
)


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

    The string is comma-separated ``key=value`` pairs, each key at most once:

    * ``base=cpu|cuda``: the op lists (default: ``device_type``'s);
    * ``compute=bf16|fp16``: the compute dtype;
    * ``output=fp32|bf16|fp16``: cast low-precision op outputs to this;
    * ``keep=norm``: keep norm layers in fp32;
    * ``lower=``, ``fp32=``, ``fp32_set_dtype=``, ``promote=``: move ops (ATen names
      joined by ``+``) into that category; ``none=`` takes ops out of every category.

    Raises:
        ValueError: unknown key, repeated key, policy, op or dtype name; the message
            gives the syntax and what was wrong.
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
    # Policies are frozen values: parse a string once, then reuse the result.
    key = (spec, device_type)
    cached = _PARSED.get(key)
    if cached is None:
        cached = _PARSED[key] = _parse(spec, device_type)
    return cached


def _parse(spec: str, device_type: str) -> Policy:
    text = spec.strip()
    if "=" not in text:
        if text not in _BUILTINS:
            raise ValueError(f"unknown policy {spec!r}; {_SYNTAX}")
        return _BUILTINS[text]
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _KEYS:
            raise ValueError(f"bad policy field {part!r} in {spec!r}: valid keys are {', '.join(_KEYS)}; {_SYNTAX}")
        if key in fields:
            raise ValueError(f"policy key {key!r} is given twice in {spec!r}; give each key once")
        fields[key] = value
    base = fields.get("base")
    if base is not None and base not in _BUILTINS:
        raise ValueError(f"unknown base={base!r} in {spec!r}; built-in policies: {', '.join(_BUILTINS)}")
    policy = _BUILTINS[base] if base is not None else default_policy(device_type)
    changes: dict[str, Any] = {}
    if "compute" in fields:
        changes["compute_dtype"] = parse_dtype(
            fields["compute"], what="compute dtype", allowed=(torch.bfloat16, torch.float16)
        )
    if "output" in fields:
        changes["output_dtype"] = parse_dtype(fields["output"], what="output dtype")
    policy = dataclasses.replace(policy, **changes)
    for key in _OP_KEYS:
        if key in fields:
            ops = [op for op in fields[key].split("+") if op.strip()]
            if not ops:
                raise ValueError(f"{key}= names no ops in {spec!r}; join ATen op names with '+' (fp32=exp+log)")
            try:
                names = [op_name(op) for op in ops]
            except ValueError as error:
                raise ValueError(f"{error} (in policy string {spec!r})") from None
            policy = policy.remove(*names, missing_ok=True) if key == "none" else policy.add(key, *names)
    if "keep" in fields:
        if fields["keep"] != "norm":
            raise ValueError(f"unknown keep={fields['keep']!r}; valid: keep=norm (keeps norm layers in fp32)")
        policy = policy.keep_modules(types=NORM_TYPES)
    return dataclasses.replace(policy, name=text)
