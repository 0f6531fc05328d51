"""Every curated mutant (``tools/mutants.py``) still finds the text it breaks, once: a change that moves or
doubles that text must carry the mutant with it, or the mutation run stops at its unmutated baseline."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_curated_mutant_finds_its_text_once() -> None:
    spec = importlib.util.spec_from_file_location("curated_mutants", ROOT / "tools" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    stale = [(m.name, (ROOT / m.path).read_text().count(m.old)) for m in module.MUTANTS
             if (ROOT / m.path).read_text().count(m.old) != 1]  # fmt: skip
    assert stale == []
    missing = [t for m in module.MUTANTS for t in m.tests if not (ROOT / t).is_file()]
    assert missing == []
