"""The import layering of ``mixprec._src``: each subsystem imports only those below it, and nothing cycles.

The subsystems, lowest first, are ``LAYERS`` (``base`` is the modules directly in ``_src``). A
module's imports of other ``mixprec._src`` modules are read from its source (every import
statement, deferred ones inside functions included; those under ``if TYPE_CHECKING:`` run never and
count only for the layering, not for cycles). The rules:

* a subsystem imports only its own modules and those of the subsystems below it;
* no cycle among modules (at run time);
* no private name (``_name``) imported from another subsystem.

    python tools/layering.py            # prints each violation; exit status 1 if any
    python tools/layering.py --counts   # modules, rooms, imports, imports across rooms, room-to-room arrows
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "mixprec" / "_src"
LAYERS = ("base", "gemms", "policy", "amp", "scaling", "fp8", "layers", "optim", "step", "prepare", "observe", "tune")
PACKAGE = "mixprec._src"


def module_name(path: pathlib.Path, src: pathlib.Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def subsystem(path: pathlib.Path, src: pathlib.Path) -> str:
    """``base`` for a module directly in ``src``, else the name of the package folder it is in."""
    parts = path.relative_to(src).parts
    return parts[0] if len(parts) > 1 else "base"


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(path: pathlib.Path, modules: set[str]) -> Iterator[tuple[str, tuple[str, ...], int, bool]]:
    """(imported module, names taken from it, line, for types only) of each import of a ``mixprec._src`` module."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE) and not node.level:
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{alias.name}"
                target, names = (sub, ()) if sub in modules else (node.module, (alias.name,))
                yield target, names, node.lineno, node.lineno in typing_only
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield alias.name, (), node.lineno, node.lineno in typing_only


def check(src: pathlib.Path = SRC, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Every violation of the rules in the module docstring, as sentences."""
    files = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    modules = set(files)
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    rank = {name: i for i, name in enumerate(layers)}
    for module, path in files.items():
        mine = subsystem(path, src)
        if mine not in rank:
            problems.append(f"{module}: subsystem {mine!r} is not in the layering {layers}")
            continue
        for target, names, line, _typing_only in imports(path, modules):
            theirs = subsystem(files[target], src) if target in files else "base"
            where = f"{path.relative_to(src.parent.parent.parent)}:{line}"
            if theirs in rank and rank[theirs] > rank[mine] and target != PACKAGE:
                problems.append(f"{where}: {mine} imports {target}, of the higher subsystem {theirs}")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and theirs != mine:
                problems.append(f"{where}: {module} imports private {', '.join(private)} from {theirs} ({target})")
            if target in graph and target != module:  # type-only imports too: no circle of any kind
                graph[module].add(target)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_a_cycle(graph, sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members, start = set(component), component[0]
    path, seen = [start], {start}
    while True:
        nxt = next(w for w in sorted(graph[path[-1]]) if w in members)
        if nxt in seen:
            return [*path[path.index(nxt) :], nxt]
        path.append(nxt)
        seen.add(nxt)


def counts(src: pathlib.Path = SRC) -> dict[str, int]:
    """The house in numbers: modules, rooms, imports between modules, those across rooms, room-to-room arrows."""
    files = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    edges = {(m, t) for m, p in files.items() for t, *_ in imports(p, set(files)) if t in files and t != m}
    room = {m: subsystem(p, src) for m, p in files.items()}
    across = {(a, b) for a, b in edges if room[a] != room[b]}
    return {"modules": len(files), "rooms": len(set(room.values())), "imports": len(edges),
            "across rooms": len(across), "room arrows": len({(room[a], room[b]) for a, b in across})}  # fmt: skip


def main() -> int:
    if "--counts" in sys.argv:
        print(", ".join(f"{v} {k}" for k, v in counts().items()))
        return 0
    problems = check()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    sys.exit(main())
