"""Precision policies: which ops run in low precision, which in fp32, as data.

A :class:`Policy` is a frozen value. It holds the op categories torch.autocast
uses (run in low precision, run in fp32, run in fp32 through the op's ``dtype``
argument, promote to the widest input, banned), the compute dtype, an optional
output dtype for low-precision ops, and per-module rules. Change it with
:meth:`Policy.add`, :meth:`Policy.remove`, :meth:`Policy.keep_modules` or
``dataclasses.replace``; each returns a new policy.

Ops are named as torch's own autocast lists name them (ATen names). A policy
equal to torch's list for a device costs nothing: autocast is then torch's. The
built-in policies (torch's lists, :func:`builtin_policy`, :func:`default_policy`)
and the printer of a policy's string form (:func:`format_policy`, ``str(policy)``)
live here too, so that printing needs no module that imports this one; ``grammar``
parses the string back.

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
import textwrap
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from mixprec._src import op_names
from mixprec._src.dtypes import NamedEnum, parse_dtype, short_name
from mixprec._src.errors import PolicyError
from mixprec._src.op_names import Op, op_name
from mixprec._src.policy import interning
from mixprec._src.policy import op_tables as tables
from mixprec._src.policy.keep import NORM_TYPES, ModuleFilter, ModuleRule, named_like_a_norm, rule_items

__all__ = [
    "BANNED_HINT",
    "BUILTINS",
    "EDITED",
    "NORM_TYPES",
    "POLICIES",
    "builtin_policy",
    "default_policy",
    "format_policy",
    "named_like_a_norm",
    "ModuleFilter",
    "ModuleRule",
    "OpCategory",
    "Policy",
    "rule_items",
]


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
    # Derived in __post_init__; read through the properties below.
    _table: dict[str, OpCategory] = dataclasses.field(init=False, repr=False, compare=False)
    _without_rules: Policy | None = dataclasses.field(init=False, repr=False, compare=False)
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)
    _token: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for field in ("lower", "fp32", "fp32_set_dtype", "promote"):
            ops = getattr(self, field)
            if isinstance(ops, str) or callable(ops):
                raise TypeError(f"Policy.{field} takes a collection of ops, got the single op {ops!r}")
            object.__setattr__(self, field, op_names.names(ops))
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
                    raise PolicyError(
                        f"{name} is in both {table[name].value!r} and {category.value!r}; an op has one category"
                    )
                table[name] = category
        object.__setattr__(self, "_table", table)
        # The policy inside a kept module, made once here rather than on every module call.
        without_rules = dataclasses.replace(self, module_rules=()) if self.module_rules else None
        object.__setattr__(self, "_without_rules", without_rules)
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.lower,
                    self.fp32,
                    self.fp32_set_dtype,
                    self.promote,
                    frozenset(self.banned.items()),
                    self.compute_dtype,
                    self.output_dtype,
                    self.module_rules,
                )
            ),
        )
        object.__setattr__(self, "_token", POLICIES.token_for(self))

    def __hash__(self) -> int:
        return self._hash

    @property
    def op_table(self) -> Mapping[str, OpCategory]:
        """Each listed op's category, by name."""
        return self._table

    @property
    def without_rules(self) -> Policy:
        """This policy with no module rules: what runs inside a module a rule matched."""
        return self if self._without_rules is None else self._without_rules

    @property
    def compile_token(self) -> str:
        """A string naming this policy in compiled graphs; equal policies share one."""
        return self._token

    def __str__(self) -> str:
        """The policy as the string :func:`mixprec.get_policy` parses back into an equal policy:
        ``base=cpu,compute=bf16,fp32=exp+softmax,none=stack,keep=norm``."""
        return format_policy(self)

    def __repr__(self) -> str:
        """``Policy('<the string form>')``, one line."""
        return f"Policy({str(self)!r})"

    def ops(self, category: OpCategory | str) -> frozenset[str]:
        """The names of the ops of one category."""
        category = OpCategory.from_name(category)
        if category is OpCategory.BANNED:
            return frozenset(self.banned)
        ops: frozenset[str] = getattr(self, category.value)
        return ops

    def category_of(self, op: Op) -> OpCategory | None:
        """The category ``op`` is in, or ``None`` if autocast leaves it alone."""
        return self._table.get(op_name(op))

    def add(self, category: OpCategory | str, *ops: Op, hint: str | None = None) -> Policy:
        """A copy with ``ops`` moved into ``category`` (out of any other).

        ``ops`` are ATen names (``"exp"``), torch callables (``torch.exp``), custom
        ops (``torch.ops.mylib.op``) or functions wrapped with :func:`mixprec.op`.
        ``hint`` is the error text for banned ops.
        """
        category = OpCategory.from_name(category)
        if not ops:
            raise PolicyError("Policy.add needs at least one op")
        moved = op_names.names(ops)
        base = self.remove(*moved, missing_ok=True)
        if category is OpCategory.BANNED:
            text = hint or BANNED_HINT
            return base._edited(banned={**base.banned, **{name: text for name in moved}})
        return base._edited(**{category.value: base.ops(category) | moved})

    def remove(self, *ops: Op, missing_ok: bool = False) -> Policy:
        """A copy where autocast leaves ``ops`` alone.

        Raises:
            ValueError: an op is in no category (unless ``missing_ok``).
        """
        drop = op_names.names(ops)
        if not missing_ok:
            for name in sorted(drop):
                if name not in self._table:
                    raise PolicyError(f"{name} is in no category of policy {self.name!r}; nothing to remove")
        return self._edited(
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
        return self.with_rules((*self.module_rules, rule))

    def with_rules(self, rules: Iterable[ModuleRule]) -> Policy:
        """A copy whose module rules are ``rules`` (first match wins)."""
        return self._edited(module_rules=tuple(rules))

    def _edited(self, **changes: Any) -> Policy:
        name = self.name if self.name.endswith(EDITED) else self.name + EDITED
        return dataclasses.replace(self, name=name, **changes)

    def describe(self, width: int = 100) -> str:
        """A readable summary: the string form, then each category's ops by name and the module rules."""
        lines = [f"Policy {self.name!r}: {self}"]
        for category in OpCategory:
            listed = sorted(self.ops(category))
            head = f"  {category.value} ({len(listed)}): "
            text = ", ".join(listed) if listed else "-"
            lines += textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * 4) or [head]
        for rule in self.module_rules:
            lines.append(f"  module rule: {rule.describe()}")
        return "\n".join(lines)


#: What a policy edited with :meth:`Policy.add`, ``remove`` or ``keep_modules`` adds to its name.
#: One object and one token per distinct policy (see ``interning``).
POLICIES: interning.Interner[Policy] = interning.Interner("policy")

EDITED = " (edited)"
#: The error text of an op banned without a hint.
BANNED_HINT = "this op is banned by the active mixprec policy"


# --- the built-in policies ---------------------------------------------------------------------------


def _installed(ops: tuple[str, ...]) -> frozenset[str]:
    """The ops of a torch list that the installed torch has (another torch than 2.13 lacks a few, e.g. 2.14 ``qr``):
    an op torch does not have is one no autocast list of it can hold."""
    return frozenset(op for op in ops if op_names.exists(op))


def _builtin(name: str) -> Policy:
    if name == "cpu":
        return Policy(
            lower=_installed(tables.CPU_LOWER),
            fp32=_installed(tables.CPU_FP32),
            promote=_installed(tables.CPU_PROMOTE),
            name="cpu",
        )
    return Policy(
        lower=_installed(tables.CUDA_LOWER),
        fp32=_installed(tables.CUDA_FP32),
        fp32_set_dtype=_installed(tables.CUDA_FP32_SET_DTYPE),
        promote=_installed(tables.CUDA_PROMOTE),
        banned={op: text for op, text in tables.CUDA_BANNED.items() if op_names.exists(op)},
        name="cuda",
    )


_DEVICE_POLICY = {"cpu": "cpu", "cuda": "cuda", "xpu": "cuda", "mps": "cuda", "hpu": "cpu", "xla": "cpu"}
# Built at import: cheap (a few hundred getattrs), and never inside a torch.compile trace.
BUILTINS: dict[str, Policy] = {name: _builtin(name) for name in ("cpu", "cuda")}


def builtin_policy(name: str) -> Policy:
    """torch's own lists for ``"cpu"`` or ``"cuda"`` (any policy may be used on any device)."""
    policy = BUILTINS.get(name)
    if policy is None:
        raise PolicyError(f"unknown policy {name!r}; built-in policies: {', '.join(BUILTINS)}")
    return policy


def default_policy(device_type: str) -> Policy:
    """The built-in policy autocast uses on ``device_type`` when none is given."""
    return builtin_policy(_DEVICE_POLICY.get(device_type, "cuda"))


# --- printing -----------------------------------------------------------------------------------


def format_policy(policy: Policy) -> str:
    """The string form of ``policy`` (see the module docstring); :func:`get_policy` parses it back."""
    base_name, moves = min(((name, _moves(policy, base)) for name, base in BUILTINS.items()), key=_length)
    fields = [f"base={base_name}"]
    if policy.compute_dtype is not None:
        fields.append(f"compute={short_name(policy.compute_dtype)}")
    if policy.output_dtype is not None:
        fields.append(f"output={short_name(policy.output_dtype)}")
    fields += moves
    for rule in policy.module_rules:
        items = "+".join(rule_items(rule))
        fields.append(f"keep={items}" if rule.dtype is torch.float32 else f"rule={items}:{short_name(rule.dtype)}")
    return ",".join(fields)


def _length(found: tuple[str, list[str]]) -> int:
    return len(",".join(found[1]))


def _moves(policy: Policy, base: Policy) -> list[str]:
    """The fields that take ``base``'s op lists to ``policy``'s."""
    table, other = policy.op_table, base.op_table
    out = []
    for category in OpCategory:
        if category is OpCategory.BANNED:
            moved = sorted(n for n, text in policy.banned.items() if base.banned.get(n) != text)
            items = [n if policy.banned[n] == BANNED_HINT else f"{n}:{policy.banned[n]!r}" for n in moved]
        else:
            items = sorted(n for n, c in table.items() if c is category and other.get(n) is not category)
        if items:
            out.append(f"{category.value}={'+'.join(items)}")
    dropped = sorted(n for n in other if n not in table)
    if dropped:
        out.append(f"none={'+'.join(dropped)}")
    return out
