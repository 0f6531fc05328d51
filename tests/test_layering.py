"""The house's rules (tools/layering.py): each subsystem of mixprec._src imports only those below it, no
import cycle, no private name across subsystems; and each rule catches its breach."""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parent.parent


layering = load_script("tools/layering.py")


def test_the_house_keeps_its_layers() -> None:
    assert layering.check() == []


def test_every_subpackage_is_a_layer_and_says_what_it_owns() -> None:
    packages = sorted(p.parent.name for p in layering.SRC.glob("*/__init__.py"))
    assert packages == sorted(layering.LAYERS[1:])
    for name in packages:
        doc = (layering.SRC / name / "__init__.py").read_text()
        assert "Owns" in doc and "May import" in doc, name


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    copy = tmp_path / "_src"
    shutil.copytree(layering.SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _add(tree: pathlib.Path, module: str, line: str) -> None:
    path = tree / module
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_an_upward_import_fails(tree: pathlib.Path) -> None:
    _add(tree, "dtypes.py", "from mixprec._src.tune import recipe")
    problems = layering.check(tree)  # (and a cycle: recipe imports dtypes)
    assert any("base imports mixprec._src.tune.recipe, of the higher subsystem tune" in p for p in problems)


def test_an_upward_import_for_types_only_fails_too(tree: pathlib.Path) -> None:
    _add(tree, "fp8/gemm.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
         "    from mixprec._src.prepare.config import PrepareConfig")  # fmt: skip
    (problem,) = layering.check(tree)
    assert "fp8 imports mixprec._src.prepare.config, of the higher subsystem prepare" in problem


def test_a_cycle_fails_even_inside_a_subsystem_and_deferred(tree: pathlib.Path) -> None:
    _add(tree, "amp/dispatch.py", "def _late():\n    from mixprec._src.amp import autocast")
    problems = layering.check(tree)
    assert len(problems) == 1 and problems[0].startswith("import cycle: mixprec._src.amp.")
    assert "mixprec._src.amp.dispatch" in problems[0] and "mixprec._src.amp.autocast" in problems[0]


def test_a_private_name_across_subsystems_fails(tree: pathlib.Path) -> None:
    _add(tree, "fp8/gemm.py", "from mixprec._src.amp.dispatch import _state_of_nothing")
    (problem,) = layering.check(tree)
    assert "imports private _state_of_nothing from amp" in problem


def test_a_package_outside_the_layering_fails(tree: pathlib.Path) -> None:
    (tree / "attic").mkdir()
    (tree / "attic" / "__init__.py").write_text('"""Nothing."""\n')
    assert any("subsystem 'attic' is not in the layering" in p for p in layering.check(tree))


def test_every_module_declares_its_public_names() -> None:
    import ast

    missing = []
    for path in sorted(layering.SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        if path.name != "__init__.py" and "__all__" not in names:
            missing.append(str(path.relative_to(layering.SRC)))
    assert missing == []


def test_no_module_is_long_without_saying_why() -> None:
    """A module over 450 lines says why in its docstring (``Long because ...``), or is split along its seams."""
    long = {}
    for path in sorted((ROOT / "src" / "mixprec").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 450 and "Long because" not in (ast.get_docstring(ast.parse(text)) or ""):
            long[path.relative_to(ROOT / "src").as_posix()] = text.count("\n")
    assert long == {}
