"""Tune: :class:`Recipe` (a precision recipe as data, and how it applies) and :func:`tune`, the search
that measures candidates on the user's machine.

Owns ``recipe``, ``measurement`` (a candidate as measured, the tolerance), ``search`` (tune itself),
``rounds`` (the rounds and the choice), ``trial`` (one candidate trained and judged), ``probes`` (the machine
and model), ``layer_plans`` (the candidates' per-layer plans), ``tables`` (how a recipe and its per-layer plan
print) and ``memory_fit`` (a memory budget: which recipes fit).
May import: every other subsystem (it is the top one).
"""

from __future__ import annotations

from typing import Any

from mixprec._src import _compat


def __getattr__(name: str) -> Any:
    return _compat.forward("tune", name)  # the flat module this package replaced: its old names, with a warning
