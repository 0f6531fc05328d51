"""Policy: which ops run in low precision, which in fp32, and which modules keep fp32.

Owns the op tables (``op_tables``), :class:`Policy` with its rules (``policy``), its text form
(``grammar``: parse and print) and the interning of equal policies (``interning``).
May import: the base modules only.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = frozenset({"op_tables", "policy", "grammar", "interning"})


def __getattr__(name: str) -> Any:
    # This package replaced the flat module ``mixprec._src.policy``: pickles made by earlier versions name its
    # classes here (``mixprec._src.policy.ModuleRule``).
    if name in _SUBMODULES or name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.policy"), name)
