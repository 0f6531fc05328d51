"""Tune: :class:`Recipe` (a precision recipe as data, and how it applies) and :func:`tune`, the search
that measures candidates on the user's machine.

Owns ``recipe``, ``search`` (the search rounds and the choice), ``tables`` (how a recipe and
its per-layer plan print) and ``memory_fit`` (a memory budget: which recipes fit).
May import: every other subsystem (it is the top one).
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = frozenset({"recipe", "search", "tables"})


def __getattr__(name: str) -> Any:
    # This package replaced the flat module ``mixprec._src.tune``: old references name its contents here.
    if name in _SUBMODULES or name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.search"), name)
