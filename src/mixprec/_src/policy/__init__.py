"""Policy: which ops run in low precision, which in fp32, and which modules keep fp32.

Owns the op tables (``op_tables``), :class:`Policy` (``rules``), the module rules it keeps modules
with (``keep``), its text form (``grammar``: parse and print) and the interning of equal policies
(``interning``).
May import: the base modules only.
"""

from __future__ import annotations

from typing import Any

from mixprec._src import _compat


def __getattr__(name: str) -> Any:
    return _compat.forward("policy", name)  # the flat module this package replaced: its old names, with a warning
