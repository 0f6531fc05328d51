"""The ``mixprec`` command as a plain ``pip install mixprec`` gives it: dependencies, optional plots."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_command_needs_no_extras() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    # rich: bench and diagnose print with it; numpy: without it torch warns on every import.
    assert {"torch", "numpy", "rich"} <= required
    assert "matplotlib" not in required  # plots are optional: pip install 'mixprec[bench]'


def test_commands_run_without_matplotlib(tmp_path: pathlib.Path) -> None:
    # A fresh process with matplotlib hidden, as in an install without the [bench] extra.
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from mixprec import cli\n"
        f"assert cli.main(['bench', '--size', 'tiny', '--steps', '3', '--workloads', 'mlp', '--quiet', "
        f"'--out', {str(tmp_path / 'bench')!r}]) == 0\n"
        f"assert cli.main(['diagnose', '--workload', 'mlp', '--out', {str(tmp_path / 'diag')!r}]) == 0\n"
    )
    src = str(ROOT / "src")
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True,
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bench.png skipped: matplotlib is not installed" in done.stderr
    assert "diagnose.png skipped: matplotlib is not installed" in done.stderr
    assert "Warning" not in done.stderr
    assert (tmp_path / "bench" / "report.json").exists() and not (tmp_path / "bench" / "bench.png").exists()
    assert (tmp_path / "diag" / "report.json").exists()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import mixprec
    from mixprec import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mixprec {mixprec.__version__} (torch {torch.__version__})"
