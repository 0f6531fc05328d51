"""One object and one name per distinct policy, for torch.compile.

torch.compile guards on the policy object a graph was traced with, and a traced
region refers to its policy by a constant. :func:`canonical` hands out one object per
distinct policy, so a policy rebuilt every step reuses the graph; :func:`token_for`
gives each distinct policy a string (a graph constant) and :func:`policy_for` maps it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixprec._src.policy.rules import Policy

__all__ = ["canonical", "policy_for", "token_for"]

_TOKENS: dict[Policy, str] = {}
_BY_TOKEN: dict[str, Policy] = {}
_CANONICAL: dict[Policy, Policy] = {}


def token_for(policy: Policy) -> str:
    """The token of ``policy``: equal policies share one.

    A string, not an int: Dynamo would make an int that changes between calls a symbolic size.
    """
    token = _TOKENS.setdefault(policy, f"policy{len(_TOKENS)}")
    _BY_TOKEN.setdefault(token, policy)
    return token


def policy_for(token: str) -> Policy:
    """The first policy given ``token``."""
    return _BY_TOKEN[token]


def canonical(policy: Policy) -> Policy:
    """The first-seen policy equal to ``policy``."""
    found = _CANONICAL.get(policy)
    if found is None:
        if len(_CANONICAL) >= 1024:  # a program building endless distinct policies: do not grow forever
            _CANONICAL.clear()
        found = _CANONICAL[policy] = policy
    return found
