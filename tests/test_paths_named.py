"""Text that names code stays true: every module path, file and public name the docstrings, comments, README
and docs/ name resolves (not through an old path), and docs/architecture.md's tree lists every module."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
import warnings

import mixprec
from helpers import ROOT
from mixprec._src import _compat

SRC = ROOT / "src" / "mixprec"
#: Paths of torch's repository that the text cites (its autocast sources and tests).
TORCH_PATHS = ("aten/", "test/")
#: mixprec's loggers: ``logging.getLogger("mixprec.scaler")`` names no attribute.
LOGGERS = set(re.findall(r'getLogger\("mixprec\.(\w+)"\)', "".join(p.read_text() for p in SRC.rglob("*.py"))))
NAMESPACES = {"fp8", "observe", "tuning", "bench", "cli", "integrations", "_src"}


def _resolves(dotted: str) -> bool:
    """Whether ``mixprec._src.a.b.C`` names a module (at its own path, not an old one) and its attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 2, -1):
        name = ".".join(parts[:i])
        if name.removeprefix("mixprec._src.") in _compat.MOVED:
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                found: object = importlib.import_module(name)
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def _exists(path: str) -> bool:
    return path.startswith(TORCH_PATHS) or any(
        (base / path).exists() for base in (SRC / "_src", SRC, ROOT, ROOT / "src")
    )


def _texts() -> list[tuple[str, int, str]]:
    """(file, line, text) of every docstring and comment in src, and every line of README.md and docs/."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and '"""' in tok.string[:4]):
                out.append((path.relative_to(ROOT).as_posix(), tok.start[0], tok.string))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        out += [(path.relative_to(ROOT).as_posix(), n, line) for n, line in enumerate(path.read_text().splitlines(), 1)]
    return out


def test_every_path_and_name_the_text_gives_resolves() -> None:
    stale = []
    for where, line, text in _texts():
        if where.endswith("_compat.py"):
            continue  # the old paths, on purpose
        for m in re.finditer(r"\bmixprec\._src(?:\.\w+)+", text):
            if not _resolves(m.group(0)):
                stale.append((where, line, m.group(0)))
        for m in re.finditer(r"(?<![\w/.-])((?:\w+/)+\w+\.(?:py|cpp|h|md))\b", text):
            if not _exists(m.group(1)):
                stale.append((where, line, m.group(1)))
        for m in re.finditer(r"(?<![\w.])mixprec\.(\w+)", text):
            if not hasattr(mixprec, m.group(1)) and m.group(1) not in NAMESPACES | LOGGERS:
                stale.append((where, line, m.group(0)))
    assert stale == []


def test_the_architecture_tree_lists_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    tree = doc[doc.index("```\nmixprec/__init__.py") : doc.index("```", doc.index("```\nmixprec/__init__.py") + 3)]
    listed, room = set(), ""
    for line in tree.splitlines():
        m = re.match(r"( *)(\S+)\s", line + " ")
        if m is None or not m.group(2).endswith((".py", "/")):
            continue
        name, depth = m.group(2), len(m.group(1))
        if depth == 2 and name.endswith("/"):
            room = name
        elif depth == 2:
            listed.add(name)
        elif depth == 4:
            listed.add(room + name)
    modules = {p.relative_to(SRC / "_src").as_posix() for p in (SRC / "_src").rglob("*.py") if p.name != "__init__.py"}
    folders = {p.relative_to(SRC / "_src").as_posix() + "/" for p in (SRC / "_src").glob("*/*") if p.is_dir()}
    folders = {f for f in folders if "__pycache__" not in f}
    assert sorted((modules | folders) - listed) == [] and sorted(listed - modules - folders) == []


def test_each_room_says_what_it_owns() -> None:
    """Each subpackage's docstring names every module it holds (``name``)."""
    unnamed = {}
    for room in sorted(p for p in (SRC / "_src").iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        missing = {p.stem for p in room.glob("*.py") if p.stem != "__init__"} - set(re.findall(r"``(\w+)``", doc))
        if missing:
            unnamed[room.name] = sorted(missing)
    assert unnamed == {}
