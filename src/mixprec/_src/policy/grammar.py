"""Policies by name and as strings: the built-in policies, and the one string form of a policy.

``str(policy)`` prints a policy as comma-separated ``key=value`` fields and
:func:`get_policy` parses that string back into an equal policy::

    base=cuda,compute=bf16,output=fp32,fp32=exp+softmax,banned=addmm:'use mm',none=stack,keep=norm+'head'

* ``base=cpu|cuda``: the built-in op lists it starts from (torch's own);
* ``compute=bf16|fp16`` and ``output=fp32|bf16|fp16``: the dtypes;
* ``lower=``, ``fp32=``, ``fp32_set_dtype=``, ``promote=``: ops moved into that category
  (ATen names joined by ``+``); ``banned=op:'hint'`` bans ops (the hint optional);
  ``none=`` takes ops out of every category;
* ``keep=ITEMS`` keeps matching modules in fp32 and ``rule=ITEMS:bf16`` runs them in
  another dtype (both may repeat, one rule each, first match wins). ITEMS joins with ``+``:
  ``norm`` (the norm layers, :data:`NORM_TYPES`), module types (``LayerNorm`` from
  ``torch.nn``, or an importable ``package.module.Class``), quoted name globs (``'blocks.*.attn'``).

Every key but ``keep`` and ``rule`` appears at most once. A policy whose rules name
types that cannot be imported by name (a class defined inside a function) prints, but
its string does not parse back.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from typing import Any

import torch
from torch import nn

from mixprec._src.dtypes import parse_dtype, short_name
from mixprec._src.errors import PolicyError
from mixprec._src.op_names import op_name
from mixprec._src.policy import op_tables as tables
from mixprec._src.policy.policy import BANNED_HINT, NORM_TYPES, ModuleRule, OpCategory, Policy


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


_CATEGORY_KEYS = ("lower", "fp32", "fp32_set_dtype", "promote", "banned")
_REPEATABLE = ("keep", "rule")
_KEYS = ("base", "compute", "output", *_CATEGORY_KEYS, "none", *_REPEATABLE)
_SYNTAX = (
    "a policy string is a built-in name (cpu, cuda) or comma-separated key=value pairs: base=cpu|cuda, "
    "compute=bf16|fp16, output=fp32|bf16|fp16, op moves such as fp32=exp+softmax, banned=addmm:'hint' or "
    "none=mm (ATen names joined by '+'), and module rules keep=norm+'head' (fp32) or rule=LayerNorm:bf16; "
    "e.g. 'base=cpu,compute=bf16,fp32=scaled_dot_product_attention,keep=norm'"
)

_PARSED: dict[tuple[str, str], Policy] = {}


def get_policy(spec: str | Policy, device_type: str = "cpu") -> Policy:
    """A policy from a name (``"cpu"``), a string (see the module docstring), or a Policy (returned as is).

    ``get_policy(str(policy)) == policy`` for every policy whose rules name importable types.
    Without ``base=`` a string starts from ``device_type``'s built-in lists.

    Raises:
        ValueError: unknown key, repeated key, policy, op, type or dtype name; the message
            gives the syntax and what was wrong.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"policy must be a mixprec.Policy or a string such as 'compute=bf16', got {type(spec).__name__}"
        )
    builtin = BUILTINS.get(spec)
    if builtin is not None:  # the one path torch.compile traces: a lookup it can follow
        return builtin
    # Policies are frozen values: parse a string once, then reuse the result.
    key = (spec, device_type)
    cached = _PARSED.get(key)
    if cached is None:
        try:
            cached = _PARSED[key] = _parse(spec, device_type)
        except PolicyError:
            raise
        except ValueError as error:  # a dtype name
            raise PolicyError(str(error)) from None
    return cached


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


def rule_items(rule: ModuleRule) -> list[str]:
    """What a rule matches, as the string form writes it: ``norm``, type names, quoted name globs."""
    types = list(rule.types)
    items = []
    if tuple(types[: len(NORM_TYPES)]) == NORM_TYPES:
        items.append("norm")
        del types[: len(NORM_TYPES)]
    items += [_type_name(t) for t in types]
    items += [repr(n) for n in rule.names]
    return items


def _type_name(cls: type) -> str:
    if getattr(nn, cls.__name__, None) is cls:
        return str(cls.__name__)
    return f"{cls.__module__}.{cls.__qualname__}"


# --- parsing ------------------------------------------------------------------------------------


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside quotes."""
    parts, current, quote = [], [], ""
    for char in text:
        if quote:
            current.append(char)
            if char == quote and (len(current) < 2 or current[-2] != "\\"):
                quote = ""
        elif char in "'\"":
            quote = char
            current.append(char)
        elif char == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _parse(spec: str, device_type: str) -> Policy:
    text = spec.strip()
    if "=" not in text:
        if text not in BUILTINS:
            raise PolicyError(f"unknown policy {spec!r}; {_SYNTAX}")
        return BUILTINS[text]
    fields: dict[str, str] = {}
    rules: list[ModuleRule] = []
    for part in filter(None, (p.strip() for p in _split(text, ","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _KEYS:
            raise PolicyError(f"bad policy field {part!r} in {spec!r}: valid keys are {', '.join(_KEYS)}; {_SYNTAX}")
        if key in _REPEATABLE:
            rules.append(_parse_rule(key, value, spec))
            continue
        if key in fields:
            raise PolicyError(f"policy key {key!r} is given twice in {spec!r}; give each key once")
        fields[key] = value
    base = fields.get("base")
    if base is not None and base not in BUILTINS:
        raise PolicyError(f"unknown base={base!r} in {spec!r}; built-in policies: {', '.join(BUILTINS)}")
    policy = BUILTINS[base] if base is not None else default_policy(device_type)
    changes: dict[str, Any] = {}
    if "compute" in fields:
        changes["compute_dtype"] = parse_dtype(
            fields["compute"], what="compute dtype", allowed=(torch.bfloat16, torch.float16)
        )
    if "output" in fields:
        changes["output_dtype"] = parse_dtype(fields["output"], what="output dtype")
    policy = dataclasses.replace(policy, **changes)
    for key in (*_CATEGORY_KEYS, "none"):
        if key in fields:
            ops = [op for op in _split(fields[key], "+") if op.strip()]
            if not ops:
                raise PolicyError(f"{key}= names no ops in {spec!r}; join ATen op names with '+' (fp32=exp+log)")
            try:
                if key == "none":
                    policy = policy.remove(*[op_name(op) for op in ops], missing_ok=True)
                elif key == "banned":
                    for op in ops:
                        name, _, hint = op.partition(":")
                        policy = policy.add(key, op_name(name), hint=_quoted(hint, spec) if hint else None)
                else:
                    policy = policy.add(key, *[op_name(op) for op in ops])
            except ValueError as error:
                raise PolicyError(f"{error} (in policy string {spec!r})") from None
    if rules:
        policy = policy.with_rules(rules)
    return dataclasses.replace(policy, name=text)


def _parse_rule(key: str, value: str, spec: str) -> ModuleRule:
    dtype: torch.dtype = torch.float32
    if key == "rule":
        items_text, sep, dtype_text = value.rpartition(":")
        if not sep or "'" in dtype_text or '"' in dtype_text:
            raise PolicyError(f"rule={value!r} in {spec!r} names no dtype; write rule=ITEMS:bf16 (keep=ITEMS for fp32)")
        value, dtype = items_text, parse_dtype(dtype_text.strip(), what="module rule dtype")
    types: list[type[nn.Module]] = []
    names: list[str] = []
    for item in (i.strip() for i in _split(value, "+")):
        if item == "norm":
            types += NORM_TYPES
        elif item and item[0] in "'\"":
            names.append(_quoted(item, spec))
        else:
            types.append(_module_type(item, key, spec))
    if not types and not names:
        raise PolicyError(f"{key}= names no modules in {spec!r}; e.g. keep=norm+'head'")
    return ModuleRule(types=tuple(types), names=tuple(names), dtype=dtype)


def _module_type(item: str, key: str, spec: str) -> type[nn.Module]:
    found: Any = getattr(nn, item, None)
    parts = item.split(".")
    for end in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            found = getattr(found, name, None)
        break
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise PolicyError(
            f"unknown {key}={item!r}; valid: {key}=norm (norm layers), a module type (LayerNorm from torch.nn, "
            f"or package.module.Class), or a quoted name pattern ('head') (in policy string {spec!r})"
        )
    return found


def _quoted(text: str, spec: str) -> str:
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, str):
        raise PolicyError(f"{text!r} in {spec!r} is not a quoted string; quote names and hints: 'head'")
    return value
