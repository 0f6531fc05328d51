"""tools/gpu_check.py (`make gpu-check`): its refusal without CUDA, its pieces and its report, run on the CPU."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

from helpers import load_script, requires_cuda

ROOT = pathlib.Path(__file__).resolve().parent.parent


gpu_check = load_script("tools/gpu_check.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_refuses_without_cuda(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "gpu-check: no CUDA GPU is available" in err and "--device cpu" in err
    assert not out.exists()  # refused before anything ran or was written


def test_the_cuda_tests_are_the_ones_it_runs(tmp_path: pathlib.Path) -> None:
    def test_example() -> None: ...

    marked = requires_cuda(test_example)
    assert {mark.name for mark in marked.pytestmark} == {"cuda", "skipif"}  # type: ignore[attr-defined]
    args = gpu_check.parser().parse_args(["--out", str(tmp_path)])
    command = gpu_check.commands(args, tmp_path)["tests"]
    assert command[:3] == [sys.executable, "-m", "pytest"] and command[3:].count("-m") == 1
    assert command[command.index("-m", 3) + 1] == "cuda" and "--junitxml" in command
    # only the modules that hold CUDA tests are collected: every such module, and no other
    modules = {pathlib.Path(c).relative_to(gpu_check.ROOT).as_posix() for c in command if c.endswith(".py")}
    assert {"tests/optim/test_fused_adam.py", "tests/observe/test_memory_plan.py"} <= modules
    assert "tests/test_cli.py" not in modules and "tests/helpers.py" not in modules


def test_a_piece_that_fails_or_runs_over_its_limit(tmp_path: pathlib.Path) -> None:
    failing = gpu_check.Piece("bench", [sys.executable, "-c", "print('x'); raise SystemExit(3)"], 30)
    gpu_check.run_piece(failing, tmp_path)
    assert failing.status == "failed" and failing.returncode == 3
    assert (tmp_path / "bench.log").read_text().strip() == "x"
    slow = gpu_check.Piece("bench-compile", [sys.executable, "-c", "import time; time.sleep(60)"], 1)
    gpu_check.run_piece(slow, tmp_path)
    assert slow.status == "timed out" and slow.seconds < 30  # interrupted (Ctrl-C) at its limit


def test_read_tests_counts_pytests_junit_xml(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2&#10;more"/></testcase>'
        '<testcase classname="tests.test_b" name="test_gpu"><skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    result = gpu_check.read_tests(tmp_path / "tests.xml")
    assert (result["passed"], result["failed"], result["skipped"]) == (1, 1, 1)
    assert result["failures"] == [{"test": "tests.test_a::test_bad", "message": ["assert 1 == 2"]}]
    assert gpu_check.read_tests(tmp_path / "missing.xml") is None


def test_report_on_the_cpu_with_tiny_sizes(tmp_path: pathlib.Path) -> None:
    code = gpu_check.main(["--device", "cpu", "--size", "tiny", "--steps", "3", "--workloads", "mlp", "--modes",
                           "torch-amp,mixprec", "--shapes", "64x64x64", "--fp8-recipes", "tensorwise", "--only",
                           "bench,fp8-gemm", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0, (tmp_path / "bench.log").read_text() + (tmp_path / "fp8-gemm.log").read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert {name: piece["status"] for name, piece in data["pieces"].items()} == {
        "tests": "not run", "bench": "ok", "bench-compile": "not run", "fp8-gemm": "ok",
        "step-cost": "not run", "llama": "not run", "llama-compile": "not run"}  # fmt: skip
    assert set(data["bench"]["workloads"]["mlp"]) == {"torch-amp", "mixprec"}
    assert [(row["m"], row["k"], row["n"]) for row in data["fp8_gemm"]["gemm"]] == [(64, 64, 64)]
    assert set(data["fp8_gemm"]["gemm"][0]["ms"]) == {"bf16", "tensorwise", "tensorwise (ATen casts)"}
    taken_apart = [line.split(":")[0].strip() for line in (tmp_path / "fp8-gemm.log").read_text().splitlines()
                   if "us to issue" in line]  # fmt: skip
    assert taken_apart == ["bf16", "tensorwise", "tensorwise (ATen casts)"]  # one call of each mode, in the log
    text = (tmp_path / "report.md").read_text()
    assert "| bench | ok |" in text and "| tests | not run |" in text
    mixprec = data["bench"]["workloads"]["mlp"]["mixprec"]
    assert f"| mlp | mixprec | {mixprec['steps_per_s']:.2f} |" in text  # the eager table, from the bench's report
    assert "| 64x64x64 |" in text and "emulated in fp32 on a CPU" in text


def test_the_llama_piece_reports_each_recipes_row(tmp_path: pathlib.Path) -> None:
    code = gpu_check.main(["--device", "cpu", "--llama-size", "tiny", "--steps", "1", "--only", "llama", "--out",
                           str(tmp_path)])  # fmt: skip
    assert code == 0, (tmp_path / "llama.log").read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    names = [row.split("|")[1].strip() for row in data["llama"][2:]]
    assert names == ["torch-amp", "O1", "O2", "bf16-pure", "bf16-sr", "O1+fp8"]
    text = (tmp_path / "report.md").read_text()
    assert "## A config-built Llama, eager" in text and data["llama"][3] in text
    heading = "## The Llama compiled (`mixprec bench --llama --compile --recipes O1+fp8,O2,bf16-sr`)"
    compiled = text[text.index(heading) :]
    assert compiled.splitlines()[2] == "Not run."


def test_a_llama_piece_stopped_at_its_limit_says_its_rows_are_partial() -> None:
    piece = gpu_check.Piece("llama-compile", [], 360.0, status="timed out", log="llama-compile.log")
    rows = ["| recipe | compiled |", "|---|---|", "| torch-amp | no |"]
    assert gpu_check._llama_lines(rows, piece) == ["Stopped at its limit (360 s): the rows it finished.", "", *rows]
    assert gpu_check._llama_lines([], piece) == ["No table: see llama-compile.log."]
    assert "llama-compile" in gpu_check.INTERRUPTIBLE and "llama" not in gpu_check.INTERRUPTIBLE


@pytest.mark.slow  # every piece on the CPU, compiling included (a minute or two on 2 cores)
def test_every_piece_on_the_cpu(tmp_path: pathlib.Path) -> None:
    code = gpu_check.main(["--device", "cpu", "--size", "tiny", "--steps", "3", "--workloads", "mlp", "--modes",
                           "fp32,torch-amp,mixprec", "--compile-modes", "torch-amp,O1", "--shapes", "64x64x64",
                           "--llama-size", "tiny", "--llama-compiled", "O2", "--limit-scale", "3", "--out",
                           str(tmp_path)])  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert all(piece["status"] == "ok" for piece in data["pieces"].values()), data["pieces"]
    tests = data["tests"]
    assert tests["failed"] == 0 and tests["skipped"] >= 9 and tests["passed"] == 0  # no GPU: all skipped
    assert {s["reason"] for s in tests["skips"]} == {"needs a CUDA GPU"}
    compiled = data["bench_compile"]["workloads"]["mlp"]
    assert compiled["O1+compile"]["recompiles"] == 0 and compiled["O1+compile"]["vs_compiled_torch_amp"] > 0
    assert data["bench_compile"]["fp8_kernels"]["variants"]["mixprec"]["kernels"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "### Compiled" in text and "| mlp | O1 |" in text and "### Kernels per fp8 linear" in text
    assert "0 passed, 0 failed" in text and "skipped: needs a CUDA GPU" in text
    assert any(row.startswith("| bf16-sr | adamw-fused |") for row in data["step_cost"])
    assert "## What a step costs" in text and "| bf16-sr | adamw-fused |" in text
    compiled_llama = [row.split("|")[1:3] for row in data["llama_compile"][2:]]
    assert [(name.strip(), flag.strip()) for name, flag in compiled_llama] == [
        ("torch-amp", "no"), ("O2", "no"), ("torch-amp", "yes"), ("O2", "yes")]  # fmt: skip
    assert "--compile --recipes O2`)" in text
