"""Names users type (dtypes, enum choices), parsed with errors that list the valid ones."""

from __future__ import annotations

import enum
from typing import TypeVar

import torch

__all__ = ["E", "LOW_PRECISION", "NamedEnum", "parse_dtype", "short_name"]

E = TypeVar("E", bound="NamedEnum")


class NamedEnum(str, enum.Enum):
    """A user-facing choice: ``from_name`` parses its value, the error lists the valid ones.

    A member is its value as a string (``Level.O2 == "O2"``, ``f"{Level.O2}"`` is ``"O2"``, JSON writes
    ``"O2"``), so strings stay accepted wherever a choice is taken and printed as users type them.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def _what(cls) -> tuple[str, str]:
        """How errors name one choice, and the valid ones."""
        return cls.__name__, f"{cls.__name__}s"

    @classmethod
    def from_name(cls: type[E], name: str | E) -> E:
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(member.value for member in cls)
            one, many = cls._what()
            raise ValueError(f"unknown {one} {name!r}; valid {many}: {valid}") from None


_BY_NAME: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_SHORT: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: dtypes autocast can compute in.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def parse_dtype(
    value: torch.dtype | str, *, what: str = "dtype", allowed: tuple[torch.dtype, ...] | None = None
) -> torch.dtype:
    """Turn ``value`` (a ``torch.dtype`` or a name such as ``"bf16"``) into a dtype.

    Raises:
        ValueError: unknown name, or a dtype outside ``allowed``; the message lists the valid ones.
        TypeError: ``value`` is neither a dtype nor a string.
    """
    allowed = allowed or tuple(_SHORT)
    if isinstance(value, str):
        dtype = _BY_NAME.get(value.strip().lower().removeprefix("torch."))
        if dtype is None:
            names = ", ".join(sorted(n for n, d in _BY_NAME.items() if d in allowed))
            raise ValueError(f"unknown {what} {value!r}; valid names: {names}")
    elif isinstance(value, torch.dtype):
        dtype = value
    else:
        raise TypeError(f"{what} must be a torch.dtype or a name such as 'bf16', got {type(value).__name__}")
    if dtype not in allowed:
        kind = "floating" if dtype.is_floating_point else "non-floating"
        valid = ", ".join(f"torch.{str(d).split('.')[-1]} ('{_SHORT[d]}')" for d in allowed)
        raise ValueError(f"{what} {dtype} is a {kind} dtype that mixprec cannot compute in; use one of {valid}")
    return dtype


def short_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; other dtypes by their torch name."""
    if dtype is None:
        return "none"
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))
