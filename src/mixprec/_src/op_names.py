"""Op names: what a policy calls an op (torch's ATen names, ``ns::name`` for custom ops).

Policies store names, never callables; :func:`op_name` turns whatever a user passes
(a name, a torch callable, an OpOverload, a custom op, a :func:`mixprec.op` function) into one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec._src.errors import PolicyError

__all__ = ["PYTHON_OPS", "exists", "names", "Op", "op_name"]

Op = str | Callable[..., Any]

# Python functions in torch whose ATen op has another name.
_ALIASES = {
    "cross_entropy": "cross_entropy_loss",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__rsub__": "rsub",
}
#: Names of Python functions made visible to policies by :func:`mixprec.op`.
PYTHON_OPS: dict[str, Callable[..., Any]] = {}


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
        if exists(candidate):
            return candidate
    raise TypeError(
        f"{op!r} is not a torch op a policy can list; name the ATen op it runs (e.g. 'mm'), "
        "or decorate your own function with @mixprec.op"
    )


def exists(name: str) -> bool:
    """Whether the installed torch has the ATen op ``name``."""
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _checked_name(text: str) -> str:
    name = text.strip()
    namespace, sep, short = name.rpartition("::")
    if not sep or namespace == "aten":
        if exists(short):
            return short
        raise PolicyError(f"unknown op {text!r}{_suggest(short)}; policies name ATen ops as torch's lists do ('mm')")
    if name in PYTHON_OPS:
        return name
    try:
        getattr(getattr(torch.ops, namespace), short)
    except (AttributeError, RuntimeError):
        raise PolicyError(
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


def names(ops: Iterable[Op]) -> frozenset[str]:
    """The policy names of ``ops`` (see :func:`op_name`)."""
    return frozenset(op_name(op) for op in ops)
