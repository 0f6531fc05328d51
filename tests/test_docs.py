"""The README's and docs' plain code blocks run (the >>> examples run as doctests)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS = [
    pytest.param(code, id=f"{path.name}:{n}")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for n, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
    if ">>>" not in code and "# template:" not in code  # templates need a launcher or a cluster
]


# torch.compile instantiates the autograd Functions it traces, which torch itself reports as deprecated
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("code", BLOCKS)
def test_code_block_runs(code: str) -> None:
    exec(compile(code, "<docs>", "exec"), {})
