"""Every curated mutant (``tools/mutants.py``) still finds the text it breaks, once: a change that moves or
doubles that text must carry the mutant with it, or the mutation run stops at its unmutated baseline."""

from __future__ import annotations

from helpers import ROOT, load_script


def test_every_curated_mutant_finds_its_text_once() -> None:
    module = load_script("tools/mutants.py")
    stale = [(m.name, (ROOT / m.path).read_text().count(m.old)) for m in module.MUTANTS
             if (ROOT / m.path).read_text().count(m.old) != 1]  # fmt: skip
    assert stale == []
    missing = [t for m in module.MUTANTS for t in m.tests if not (ROOT / t).is_file()]
    assert missing == []
