"""PyTorch's own GradScaler and autocast tests, run with plain torch and with mixprec swapped in.

The tests are PyTorch's code (BSD licence), kept outside the project in ``<repo>/../shared/peer-tests``
and run from there. ``tests/peer/swap_plugin.py`` rebinds torch's ``GradScaler`` and ``autocast``
names to mixprec's before the test module is imported, and counts mixprec's constructions so the
test can prove the swap was real. Each file runs twice, in two subprocesses at once (plain torch, and swapped):
every test that passes with torch must pass with mixprec, except the few in ``NOT_APPLICABLE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PEER_DIR = REPO.parent / "shared" / "peer-tests"
PLUGIN_DIR = REPO / "tests" / "peer"

# Tests that only exercise torch itself, with the reason. Keep it short: everything else must pass.
NOT_APPLICABLE = {
    "test_torch_grad_scaling.py::TestTorchDeviceTypeCPU::test_grad_scaler_deprecated_warning_cpu": (
        "checks the FutureWarning of torch.cpu.amp.GradScaler, torch's deprecated alias; mixprec has no "
        "deprecated alias (the swap binds that name to mixprec.GradScaler on 'cpu')"
    ),
    "test_autocast.py::TestAutocastCPU::test_cpu_autocast_deprecated_warning": (
        "checks the FutureWarning of torch.cpu.amp.autocast, torch's deprecated alias; mixprec has no "
        "deprecated alias (the swap binds that name to mixprec.autocast on 'cpu')"
    ),
}

# Which of mixprec's classes each file must construct for the swap to count as real.
SWAPPED = {"test_torch_grad_scaling.py": "GradScaler", "test_autocast.py": "autocast"}


def _run(name: str, tmp_path: Path, *, swap: bool) -> tuple[dict[str, str], dict[str, int]]:
    """Run one peer file; returns each test's outcome by id (``file::Class::test``) and the swap counts."""
    label = "mixprec" if swap else "torch"
    junit, report = tmp_path / f"{label}.xml", tmp_path / f"{label}-swap.json"
    command = [sys.executable, "-m", "pytest", name, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "-c", os.devnull, "--rootdir", str(PEER_DIR)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(PLUGIN_DIR), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the peer folder is not ours to write into
    if swap:
        command += ["-p", "swap_plugin"]
        env["MIXPREC_SWAP_REPORT"] = str(report)
    done = subprocess.run(command, cwd=PEER_DIR, env=env, capture_output=True, text=True, timeout=900, check=False)
    # 0: all passed, 1: some failed; anything else (collection or usage error) is the harness's problem.
    assert done.returncode in (0, 1) and junit.exists(), (
        f"{label} run broke:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
    )
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{name}::{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[test_id] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    counts = json.loads(report.read_text()) if swap else {}
    return outcomes, counts


@pytest.mark.parametrize(
    "name",
    [
        "test_torch_grad_scaling.py",
        "test_autocast.py",
    ],
)
def test_torch_own_tests_pass_with_mixprec_swapped_in(name: str, tmp_path: Path) -> None:
    if not (PEER_DIR / name).is_file():
        pytest.skip(
            f"PyTorch's peer tests are not here: expected {PEER_DIR / name} (shared/peer-tests beside the repo)"
        )
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side, one a core
        torch_run = pool.submit(_run, name, tmp_path, swap=False)
        mixprec_run = pool.submit(_run, name, tmp_path, swap=True)
        (with_torch, _), (with_mixprec, counts) = torch_run.result(), mixprec_run.result()
    assert counts.get(SWAPPED[name], 0) > 0, f"the swap was not real: mixprec constructions {counts}"
    passing = {test for test, outcome in with_torch.items() if outcome == "passed"}
    assert passing, f"nothing passed with plain torch: {with_torch}"
    not_applicable = {test for test in NOT_APPLICABLE if test.startswith(f"{name}::")}
    assert not_applicable <= set(with_torch), f"NOT_APPLICABLE names tests that do not exist: {not_applicable}"
    stale = sorted(test for test in not_applicable if with_mixprec.get(test) == "passed")
    assert not stale, f"these pass with mixprec now: remove them from NOT_APPLICABLE: {stale}"
    regressions = sorted(test for test in passing - not_applicable if with_mixprec.get(test) != "passed")
    assert not regressions, (
        f"{len(regressions)} of {len(passing)} tests that pass with torch fail with mixprec: {regressions}"
    )
