"""Casting values that hold tensors: which tensors autocast casts, and a cast that keeps containers.

:func:`eligible` is torch's rule (a floating tensor, not fp64, on the autocast device).
:func:`cast_floating` casts the eligible tensors inside any value and rebuilds each container
as its own type (tuple, namedtuple, list, dict and its subclasses such as Hugging Face's
``ModelOutput``, dataclasses). It casts module outputs (prepare), the inputs of modules kept
in fp32 or run by a module rule, and ``custom_fwd``'s ``cast_inputs``. The dispatcher kernels
cast op arguments with their own loop (``dispatch.cast_all``): an op takes tensors and lists
of tensors only, and its cast goes through the weight-cast cache as torch's ``cached_cast`` does.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

__all__ = ["cast_floating", "eligible"]

_Tensor = torch.Tensor
_float64 = torch.float64


def eligible(t: Any, device_type: str | None) -> bool:
    """torch's rule: a floating tensor, not fp64, on ``device_type`` (any device when ``None``)."""
    return (
        isinstance(t, _Tensor)
        and t.is_floating_point()
        and t.dtype is not _float64
        and (device_type is None or (t.is_cpu if device_type == "cpu" else t.device.type == device_type))
    )


def cast_floating(value: Any, dtype: torch.dtype, device_type: str | None = None) -> Any:
    """``value`` with every eligible tensor in it cast to ``dtype``; containers keep their type."""
    if isinstance(value, _Tensor):
        return value.to(dtype) if value.dtype is not dtype and eligible(value, device_type) else value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype, device_type) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [cast_floating(v, dtype, device_type) for v in value]
    if type(value) is dict:  # kwargs and plain dicts: a comprehension Dynamo traces
        return {key: cast_floating(item, dtype, device_type) for key, item in value.items()}
    if isinstance(value, dict):
        new = copy.copy(value)  # the same class: a ModelOutput stays one, its attributes too
        for key, item in value.items():
            new[key] = cast_floating(item, dtype, device_type)
        return new
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: cast_floating(getattr(value, f.name), dtype, device_type)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **fields)
    return value
