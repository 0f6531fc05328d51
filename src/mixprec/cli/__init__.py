"""The ``mixprec`` command: ``mixprec bench``, ``diagnose``, ``tune``, ``memory-plan`` and ``policy``.

One module a subcommand (``bench``, ``diagnose``, ``tune``, ``memory_plan``, ``policy``), the arguments in
``parser``, what they share in ``common``; :func:`main` dispatches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from mixprec.cli import bench, diagnose, memory_plan, parser, policy, tune

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script."""
    args = parser.build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            return bench.run(args)
        if args.command == "diagnose":
            return diagnose.run(args)
        if args.command == "tune":
            return tune.run(args)
        if args.command == "memory-plan":
            return memory_plan.run(args)
        return policy.run(args)
    except BrokenPipeError:  # the reader went away (`mixprec policy cpu | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
