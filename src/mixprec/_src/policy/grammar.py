"""Policies from strings: :func:`get_policy` parses the one string form of a policy.

``str(policy)`` (the printer, beside :class:`Policy` in ``policy``) prints a policy as
comma-separated ``key=value`` fields and :func:`get_policy` parses that string back into an
equal policy::

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

from mixprec._src.dtypes import parse_dtype
from mixprec._src.errors import PolicyError
from mixprec._src.op_names import op_name
from mixprec._src.policy.rules import BUILTINS, NORM_TYPES, ModuleRule, Policy, default_policy

__all__ = ["get_policy"]

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
