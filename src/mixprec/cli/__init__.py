"""The ``mixprec`` command: ``mixprec bench``, ``mixprec diagnose``, ``mixprec tune`` and ``mixprec policy``.

One module a subcommand (``bench``, ``diagnose``, ``tune``, ``policy``), the arguments in
``parser``, what they share in ``common``; :func:`main` dispatches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from mixprec.cli import bench, diagnose, parser, policy, tune

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
        return policy.run(args)
    except BrokenPipeError:  # the reader went away (`mixprec policy cpu | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
