"""The mutation score of the last ``mutmut run``, per module: killed / mutants the tests reach.

    python tools/mutation_score.py             # after `mutmut run` (or `make mutants`)
    python tools/mutation_score.py --survivors # and the surviving mutants' names (`mutmut show NAME`)

A mutant no selected test runs ("no tests") is counted apart: mutmut finds which tests reach a
function by running them in this process, so code that runs only in spawned processes (the
distributed tests) shows there; ``tools/mutants.py`` covers it with mutants of its own.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

_MODULE = re.compile(r"^(.*?)\.x[ǁ_]")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants")
    args = parser.parse_args(argv)
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    survivors = []
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if not name:
            continue
        found = _MODULE.match(name)  # mixprec._src.scaling.scaler.xǁGradScalerǁstep__mutmut_3, ....x_helper__mutmut_1
        module = found.group(1) if found else name.rsplit(".", 1)[0]
        by_module[module][status] += 1
        if status == "survived":
            survivors.append(name)
    print(f"{'module':34} {'mutants':>8} {'killed':>7} {'survived':>9} {'no tests':>9} {'timeout':>8} {'score':>7}")
    total: collections.Counter[str] = collections.Counter()
    for module, counts in sorted(by_module.items()):
        total.update(counts)
        _row(module, counts)
    _row("all", total)
    if args.survivors:
        print("\n".join(survivors))
    return 0


def _row(name: str, counts: collections.Counter[str]) -> None:
    reached = sum(counts.values()) - counts["no tests"] - counts["skipped"]
    killed = counts["killed"] + counts["timeout"]
    score = 100.0 * killed / reached if reached else 0.0
    print(f"{name:34} {sum(counts.values()):8} {counts['killed']:7} {counts['survived']:9} {counts['no tests']:9} "
          f"{counts['timeout']:8} {score:6.1f}%")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
