"""``mixprec policy``: a policy, built in or from its string form, described."""

from __future__ import annotations

import argparse
import shutil
import sys

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    from mixprec._src.policy.grammar import get_policy

    try:
        policy = get_policy(args.spec)
    except ValueError as exc:
        print(f"mixprec policy: {exc}", file=sys.stderr)
        return 2
    width = max(60, min(shutil.get_terminal_size().columns, 120))
    print(repr(policy))
    print(policy.describe(width=width))
    return 0
