"""One object and one name per distinct value, for torch.compile: :class:`Interner`.

torch.compile guards on the policy object a graph was traced with, and a traced region refers to its
policy by a constant. :meth:`Interner.canonical` hands out one object per distinct value, so a policy
rebuilt every step reuses the graph; :meth:`Interner.token_for` gives each distinct value a string (a
graph constant) and :meth:`Interner.value_for` maps it back. ``policy.rules`` keeps the policies' one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Interner"]

T = TypeVar("T", bound=Hashable)
_MOST = 1024  # canonical values kept: a program building endless distinct policies does not grow forever


class Interner(Generic[T]):
    """Tokens and canonical objects of hashable values; host-side dictionaries only."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._tokens: dict[T, str] = {}
        self._by_token: dict[str, T] = {}
        self._canonical: dict[T, T] = {}

    def token_for(self, value: T) -> str:
        """The token of ``value``: equal values share one.

        A string, not an int: Dynamo would make an int that changes between calls a symbolic size.
        """
        token = self._tokens.setdefault(value, f"{self.prefix}{len(self._tokens)}")
        self._by_token.setdefault(token, value)
        return token

    def value_for(self, token: str) -> T:
        """The first value given ``token``."""
        return self._by_token[token]

    def canonical(self, value: T) -> T:
        """The first-seen value equal to ``value``."""
        found = self._canonical.get(value)
        if found is None:
            if len(self._canonical) >= _MOST:
                self._canonical.clear()
            found = self._canonical[value] = value
        return found
