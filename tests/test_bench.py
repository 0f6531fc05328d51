"""mixprec bench: every workload in every mode, the report's schema, the PNG, the CLI."""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

import matplotlib.image
import pytest
import torch
from torch import nn

import mixprec
from mixprec import cli
from mixprec.bench import MODES, WORKLOADS, BenchConfig, Mode, register_mode, resolve_device, resolve_dtype
from mixprec.bench.runner import run
from mixprec.bench.workloads import checker, grid, markov_text


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    assert cli.main(["bench", "--size", "tiny", "--steps", "3", "--quiet", "--out", str(out),
                     "--json", str(out / "copy.json")]) == 0  # fmt: skip
    return out, json.loads((out / "report.json").read_text())


def test_report_schema(tiny_report: tuple[pathlib.Path, dict[str, Any]]) -> None:
    out, report = tiny_report
    assert report["device"] == "cpu" and report["dtype"] == "bf16" and report["torch"] == torch.__version__
    assert set(report["workloads"]) == set(WORKLOADS)
    for name, modes in report["workloads"].items():
        expected = {"fp32", "torch-amp", "mixprec", "mixprec-tuned"} | (
            {"mixprec-cl"} if WORKLOADS[name].conv else set()
        )
        assert set(modes) == expected, name
        assert isinstance(modes["mixprec-tuned"]["tuning_s"], float) and modes["mixprec-tuned"]["recipe"]
        assert "choice" in modes["mixprec-tuned"]["layer_plan"]  # tune's per-layer table
        assert modes["fp32"]["tuning_s"] is None and modes["fp32"]["recipe"] is None
        for mode, r in modes.items():
            assert isinstance(r["steps_per_s"], float) and r["steps_per_s"] > 0
            assert isinstance(r["final_loss"], float)
            assert r["peak_mem_bytes"] is None or isinstance(r["peak_mem_bytes"], int)
            assert isinstance(r["speedup_vs_fp32"], float)
            assert len(r["losses"]) == 3
            if mode == "fp32":
                assert r["speedup_vs_fp32"] == 1.0 and r["loss_rel_diff_vs_fp32"] == 0.0
    assert json.loads((out / "copy.json").read_text()) == report


def test_report_markdown_and_png(tiny_report: tuple[pathlib.Path, dict[str, Any]]) -> None:
    out, _ = tiny_report
    text = (out / "report.md").read_text()
    assert "| workload | mode | steps/s |" in text
    assert text.count("| checkerboard |") == 5
    assert "Recipes chosen by mixprec.tune:" in text and "- checkerboard (mixprec-tuned): `" in text
    assert "Per-layer plan (ms: forward and both backward GEMMs" in text and "blocks.layers.0.linear1" in text
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800
    assert pixels.std() > 0.05  # not a blank canvas


def test_same_numbers_in_torch_amp_and_mixprec_modes(tiny_report: tuple[pathlib.Path, dict[str, Any]]) -> None:
    _, report = tiny_report
    for modes in report["workloads"].values():
        assert modes["mixprec"]["losses"] == modes["torch-amp"]["losses"]  # drop-in: bit for bit


def test_fp16_modes_use_a_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    scaled: dict[str, int] = {"torch": 0, "mixprec": 0}
    for name, cls in (("torch", torch.amp.GradScaler), ("mixprec", mixprec.GradScaler)):
        original = cls.scale
        monkeypatch.setattr(cls, "scale", lambda self, loss, original=original, name=name: (
            scaled.__setitem__(name, scaled[name] + 1), original(self, loss))[1])  # fmt: skip
    report = run(BenchConfig(workloads=("mlp",), modes=("torch-amp", "mixprec"), steps=3, size="tiny", dtype="fp16"))
    assert report.dtype == "fp16"
    assert report.results["mlp"]["mixprec"].losses == report.results["mlp"]["torch-amp"].losses
    assert scaled["torch"] >= 3 and scaled["mixprec"] >= 3  # each mode's every step scaled its loss


def test_modes_registry_is_open() -> None:
    seen = []

    def prepare(model: nn.Module) -> nn.Module:
        seen.append(type(model).__name__)
        return model

    register_mode(Mode("test-mode", "a mode registered by a test", prepare_model=prepare, low_precision=False))
    try:
        report = run(BenchConfig(workloads=("mlp",), modes=("fp32", "test-mode"), steps=2, warmup=1, size="tiny"))
        assert report.results["mlp"]["test-mode"].losses == report.results["mlp"]["fp32"].losses
        assert seen
    finally:
        del MODES["test-mode"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workloads": ("resnet",)}, "unknown workload 'resnet'; valid: checkerboard, mlp"),
        ({"modes": ("O3",)}, "unknown mode 'O3'; valid: fp32"),
        ({"size": "huge"}, "unknown size 'huge'"),
        ({"steps": 2, "warmup": 2}, "steps must exceed warmup"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)


def test_device_and_dtype_resolution() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cpu")) is torch.float16
    with pytest.raises(ValueError, match="valid: auto, bf16, fp16"):
        resolve_dtype("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="use auto, cpu or cuda"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_cli_rejects_bad_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--workloads", "mlp,resnet"])
    assert exc.value.code == 2
    assert "unknown workload 'resnet'; valid: checkerboard, mlp, transformer, cnn" in capsys.readouterr().err
    assert cli.main(["bench", "--device", "tpu"]) == 2
    assert "use auto, cpu or cuda" in capsys.readouterr().err


def test_cli_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["policy", "cuda"]) == 0
    assert "fp32_set_dtype (" in capsys.readouterr().out
    assert cli.main(["policy", "compute=int4"]) == 2
    assert "valid names" in capsys.readouterr().err


def test_workload_data() -> None:
    assert grid(6, 4).shape == (2, 4, 6)
    board = checker(16, 16, 8)
    assert board.shape == (16, 16) and set(board.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(markov_text(500), markov_text(500))
    text = markov_text(5000)
    assert text.min() >= 0 and text.max() < 256


def test_to_channels_last() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(2, 2))
    mixprec.to_channels_last(model)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(mixprec.to_channels_last(x), x)
    assert mixprec.to_channels_last(torch.randn(1, 2, 3, 4, 5)).is_contiguous(memory_format=torch.channels_last_3d)
    with pytest.raises(ValueError, match="4-D"):
        mixprec.to_channels_last(torch.randn(3, 3))
    with pytest.raises(TypeError, match=r"nn\.Module or a tensor"):
        mixprec.to_channels_last([1, 2])  # type: ignore[type-var]


def test_compile_mode_reports_compiled_and_eager_side_by_side() -> None:
    report = run(BenchConfig(workloads=("mlp",), modes=("fp32", "mixprec"), steps=3, warmup=1, size="tiny",
                             compile=True))  # fmt: skip
    rows = report.results["mlp"]
    assert set(rows) == {"fp32", "mixprec", "fp32+compile", "mixprec+compile"}
    for name in ("fp32", "mixprec"):
        compiled, eager = rows[f"{name}+compile"], rows[name]
        assert compiled.speedup_vs_fp32 is not None and compiled.steps_per_s > 0
        # inductor may fuse differently: the same training, not necessarily the same bits
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(compiled.losses, eager.losses, strict=True))


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_cli_checks_outputs_before_running(
    flag: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the bench ran although its output cannot be written")

    monkeypatch.setattr("mixprec.bench.runner.run", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "sub" / ("report.json" if flag == "--json" else "out")  # a path under a regular file
    args = ["bench", "--size", "tiny", "--workloads", "mlp", "--quiet", "--out", str(tmp_path / "ok")]
    assert cli.main([*args, flag, str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"mixprec bench: cannot write {flag}" in err and str(bad) in err
    assert cli.main([*args, "--json", str(tmp_path)]) == 2  # a folder, not a file
    assert "is a folder" in capsys.readouterr().err


def test_ctrl_c_writes_what_finished(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.bench import runner

    step, run_workload = runner._Run.step, runner.run_workload
    calls: list[str] = []

    def counted(workload: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(workload)
        return run_workload(workload, *args, **kwargs)

    def interrupted(self: Any, i: int) -> float:
        if len(calls) == 4:  # warm-up of mlp and transformer, then mlp, then the transformer's main pass
            raise KeyboardInterrupt
        return step(self, i)

    monkeypatch.setattr(runner, "run_workload", counted)
    monkeypatch.setattr(runner._Run, "step", interrupted)
    out = tmp_path / "out"
    code = cli.main(["bench", "--size", "tiny", "--steps", "3", "--workloads", "mlp,transformer", "--modes",
                     "fp32,mixprec", "--quiet", "--out", str(out), "--json", str(tmp_path / "copy.json")])  # fmt: skip
    assert code == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "interrupted: 1 of 2 workloads finished (mlp)" in captured.err
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is True and set(report["workloads"]) == {"mlp"}
    assert json.loads((tmp_path / "copy.json").read_text()) == report
    assert "Interrupted" in (out / "report.md").read_text()


def test_a_workload_that_raises_loses_no_finished_work_and_is_named(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.bench import runner

    step, run_workload = runner._Run.step, runner.run_workload
    calls: list[str] = []
    written: list[set[str]] = []
    from mixprec.bench import report as report_module

    runner_report_write = report_module.write

    def counted(workload: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(workload)
        return run_workload(workload, *args, **kwargs)

    def broken(self: Any, i: int) -> float:
        if len(calls) == 4:  # the warm-up of both, mlp, then checkerboard's main pass raises
            raise RuntimeError("a kernel failed")
        return step(self, i)

    def recorded(report: Any, *args: Any, **kwargs: Any) -> Any:
        written.append(set(report.results))
        return runner_report_write(report, *args, **kwargs)

    monkeypatch.setattr(runner, "run_workload", counted)
    monkeypatch.setattr(runner._Run, "step", broken)
    monkeypatch.setattr("mixprec.bench.report.write", recorded)
    out = tmp_path / "out"
    code = cli.main(["bench", "--size", "tiny", "--steps", "3", "--workloads", "mlp,checkerboard", "--modes",
                     "fp32,mixprec", "--quiet", "--out", str(out)])  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "workload checkerboard failed: RuntimeError: a kernel failed" in captured.err
    report = json.loads((out / "report.json").read_text())
    assert set(report["workloads"]) == {"mlp"} and report["failed"] == {"checkerboard": "RuntimeError: a kernel failed"}
    assert "**checkerboard failed**: RuntimeError: a kernel failed" in (out / "report.md").read_text()
    assert written[0] == {"mlp"}  # written as it finished, before the next workload ran


def _bench_table(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, *flags: str) -> list[str]:
    """The checkerboard lines of a tiny bench: its 5 progress lines, then its 5 table rows."""
    assert cli.main(["bench", "--size", "tiny", "--steps", "3", "--workloads", "checkerboard", *flags,
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    return [line.strip("│ ") for line in out if "checkerboard" in line and ("MiB" in line or "final loss" in line)]


def test_cli_table_is_plain_text_in_a_log(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    lines = _bench_table(capsys, tmp_path)  # captured: stdout is not a TTY; no --quiet
    progress, rows = lines[:5], lines[5:]
    assert all("steps/s" in line and "final loss" in line for line in progress)  # one line each, not wrapped
    assert [row.split()[1] for row in rows] == ["fp32", "torch-amp", "mixprec", "mixprec-cl", "mixprec-tuned"]
    report = json.loads((tmp_path / "report.json").read_text())
    for row in rows:
        assert "…" not in row and "│" not in row
        assert f"{report['workloads']['checkerboard'][row.split()[1]]['final_loss']:.4f}" in row


@pytest.mark.slow  # a whole bench run in a pseudo-terminal; the log case covers the plain table
def test_cli_table_is_plain_text_in_a_narrow_terminal(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli.sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "80")
    rows = _bench_table(capsys, tmp_path, "--quiet")[5:]
    assert len(rows) == 5 and not any("…" in row for row in rows)
    monkeypatch.setenv("COLUMNS", "200")  # wide enough: the rich table, nothing cut
    rows = _bench_table(capsys, tmp_path, "--quiet")[5:]
    assert len(rows) == 5 and all("│" in row and "…" not in row for row in rows)


def test_cli_warns_that_fp16_is_slow_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    assert cli.main(["bench", "--size", "tiny", "--steps", "3", "--workloads", "mlp", "--modes", "fp32,mixprec",
                     "--dtype", "fp16", "--device", "cpu", "--quiet", "--out", str(tmp_path)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "fp16 has no fast path on most CPUs" in err and "use --dtype bf16" in err


def test_png_shows_what_differs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    from mixprec.bench import report as report_module

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    report = run(BenchConfig(workloads=("checkerboard", "mlp"), modes=("fp32", "torch-amp", "mixprec"), steps=3,
                             warmup=1, size="tiny"))  # fmt: skip
    report_module.plot(report, tmp_path / "bench.png")
    (figure,) = figures
    titles = [ax.get_title() for ax in figure.axes]
    assert not any(ax.images for ax in figure.axes)  # no half-trained checkerboard beside its target
    assert "checkerboard: loss vs fp32" in titles and "mlp: loss vs fp32" in titles
    relative = next(ax for ax in figure.axes if ax.get_title() == "mlp: loss vs fp32")
    assert {line.get_label() for line in relative.lines} >= {"torch-amp", "mixprec"}


def test_ctrl_c_before_any_workload_finished(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.bench import runner

    def interrupted(self: Any, i: int) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner._Run, "step", interrupted)
    out = tmp_path / "out"
    assert cli.main(["bench", "--size", "tiny", "--workloads", "mlp", "--quiet", "--out", str(out)]) == 130
    assert "interrupted before any workload finished; nothing written" in capsys.readouterr().err
    assert not (out / "report.json").exists()


def test_cli_output_piped_into_head_ends_quietly() -> None:
    import subprocess
    import sys

    # `true` reads nothing and exits at once: every write of the command meets a closed pipe.
    command = ["bash", "-c", f"set -o pipefail; {sys.executable} -m mixprec.cli policy cuda | true"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr
    assert done.returncode == 0


@pytest.mark.slow  # two spawned processes, half a minute
def test_cli_sharded_bench_over_two_processes(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    from mixprec.bench import sharded

    out = tmp_path / "bench"
    assert cli.main(["bench", "--nproc", "2", "--size", "tiny", "--steps", "3", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "sharded.json").read_text())
    assert (out / "sharded.md").read_text().count("| transformer |") == 7 + 6
    two, one = report["results"]["2"]["transformer"], report["results"]["1"]["transformer"]
    assert list(two) == list(sharded.SHARDED_MODES) and "torch-mp" not in one  # MixedPrecisionPolicy: sharded only
    for level, reference in sharded.TORCH_EQUIVALENT.items():
        result = two[level]
        assert result["world_size"] == 2 and result["steps_per_s"] > 0
        assert result["vs_torch"] == pytest.approx(result["steps_per_s"] / two[reference]["steps_per_s"])
        # the state each rank holds: half of one process's (O2: its copies are gathered only around each forward)
        assert result["state_vs_one_process"] <= 0.5 * 1.05, level
        assert abs(result["loss_vs_one_process"]) < 0.01
        assert set(result["memory"]) >= {"parameters", "masters", "gradients", "optimizer_state", "total"}
    assert two["O2"]["memory"]["masters"] > 0 and two["O1"]["memory"]["masters"] == 0
    assert "transformer  O2" in printed and "wrote" in printed
    assert cli.main(["bench", "--nproc", "0", "--out", str(out)]) == 2  # bad input, before any process starts


def test_fp8_modes_train_and_say_they_are_emulated_on_a_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    assert cli.main(["bench", "--workloads", "mlp", "--modes", "mixprec,fp8,fp8-delayed", "--size", "tiny",
                     "--steps", "3", "--quiet", "--out", str(tmp_path)]) == 0  # fmt: skip
    shown = capsys.readouterr().out
    assert "fp8 GEMMs are emulated in fp32 on a CPU" in shown
    assert "fp8 GEMMs are emulated in fp32 on a CPU" in (tmp_path / "report.md").read_text()
    modes = json.loads((tmp_path / "report.json").read_text())["workloads"]["mlp"]
    assert modes["fp8"]["losses"] != modes["mixprec"]["losses"]  # fp8 numerics, not bf16's
    assert (
        abs(modes["fp8-delayed"]["final_loss"] - modes["mixprec"]["final_loss"]) < 0.1 * modes["mixprec"]["final_loss"]
    )


def test_block_scaled_modes_train_and_say_they_are_emulated(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    assert cli.main(["bench", "--workloads", "mlp", "--modes", "mixprec,mxfp8,nvfp4", "--size", "tiny",
                     "--steps", "3", "--quiet", "--out", str(tmp_path)]) == 0  # fmt: skip
    shown = capsys.readouterr().out
    for text in (shown, (tmp_path / "report.md").read_text()):
        assert "block-scaled GEMMs are emulated on every device" in text
        assert "fp8 GEMMs are emulated in fp32 on a CPU" not in text  # no tensorwise-style fp8 mode ran
    modes = json.loads((tmp_path / "report.json").read_text())["workloads"]["mlp"]
    assert modes["mxfp8"]["losses"] != modes["mixprec"]["losses"] != modes["nvfp4"]["losses"]


def test_fp8_modes_skip_conv_workloads() -> None:
    assert MODES["fp8"].trains(conv=False) and not MODES["fp8"].trains(conv=True)
    assert MODES["mixprec-cl"].trains(conv=True) and not MODES["mixprec-cl"].trains(conv=False)
    assert MODES["mixprec"].trains(conv=True) and MODES["mixprec"].trains(conv=False)
    report = run(BenchConfig(workloads=("checkerboard",), modes=("mixprec", "fp8"), steps=2, warmup=1, size="tiny"))
    assert set(report.results["checkerboard"]) == {"mixprec"}


def test_the_tuned_mode_trains_with_the_recipes_per_layer_plan() -> None:
    from mixprec import LayerChoice, Recipe
    from mixprec.bench.modes import recipe_mode

    plan = (LayerChoice("blocks.layers.0.linear1", "linear", {"fp32": 1.0}, {}, "fp32", "kept"),)
    mode = recipe_mode(Recipe(dtype="bf16", layers=plan))
    task = WORKLOADS["transformer"].build("tiny", torch.device("cpu"))
    assert mode.setup is not None and mode.recipe is not None
    model, _ = mode.setup(task.model, torch.optim.AdamW(task.model.parameters()), torch.bfloat16)
    assert mixprec.layer_precision(model, "blocks.layers.0.linear1") == "fp32"
    assert mixprec.layer_precision(model, "blocks.layers.0.linear2") is None


def test_compiled_runs_are_compiled_timed_after_warm_up_and_recompiles_counted() -> None:
    from torch._dynamo.utils import counters

    from mixprec.bench import report as report_module

    warm = [False]

    def relayout(x: torch.Tensor) -> torch.Tensor:  # after the compiled run's warm-up: the same values, new strides
        return x.t().contiguous().t() if warm[0] else x

    def progress(workload: str, mode: str, done: int, total: int) -> None:
        warm[0] = warm[0] or (mode == "test-relayout+compile" and done == 1)

    def doubled(model: nn.Module) -> nn.Module:  # the same model as test-relayout's, but for a hook on its head
        list(model.children())[-1].register_forward_hook(lambda module, args, out: out * 2)
        return model

    register_mode(Mode("test-relayout", "fp32, the inputs' strides change after the compiled run's warm-up",
                       prepare_input=relayout, low_precision=False))  # fmt: skip
    register_mode(Mode("test-hooked", "fp32, a hook doubles the output", prepare_model=doubled, low_precision=False))
    graphs = counters["stats"]["unique_graphs"]
    try:
        report = run(BenchConfig(workloads=("mlp",), modes=("torch-amp", "O1", "test-relayout", "test-hooked"),
                                 steps=3, warmup=1, size="tiny", compile=True), progress=progress)  # fmt: skip
    finally:
        del MODES["test-relayout"], MODES["test-hooked"]
    assert counters["stats"]["unique_graphs"] - graphs >= 4  # dynamo compiled a graph per compiled mode at least
    rows = report.results["mlp"]
    # torch guards no module hooks by default: the hooked model would run the graph traced for test-relayout's
    hooked = rows["test-hooked+compile"]
    assert hooked.graphs is not None and hooked.graphs >= 1
    assert hooked.losses == pytest.approx(rows["test-hooked"].losses, rel=1e-4)
    assert hooked.losses != pytest.approx(rows["test-relayout"].losses, rel=1e-2)
    for name in ("torch-amp", "O1"):
        compiled, eager = rows[f"{name}+compile"], rows[name]
        assert compiled.compiled and not eager.compiled and eager.graphs is None
        assert compiled.graphs is not None and compiled.graphs >= 1, name  # it compiled a graph of its own
        assert compiled.recompiles == 0 and compiled.eager_frames == 0 and compiled.graph_breaks == 0
        assert compiled.compile_s is not None and compiled.compile_s >= 0
        assert compiled.vs_eager == pytest.approx(compiled.steps_per_s / eager.steps_per_s)
        assert compiled.vs_compiled_torch_amp == pytest.approx(
            compiled.steps_per_s / rows["torch-amp+compile"].steps_per_s
        )
    # A guard that fails after warm-up (the inputs' strides) is a recompile, and the table says so.
    assert rows["test-relayout+compile"].recompiles == 1
    text = report_module.markdown(report)
    main, _, compiled_section = text.partition("## Compiled")
    assert "+compile" not in main  # the compiled runs have their own table
    assert "| " + " | ".join(report_module.COMPILED_HEADER) + " |" in compiled_section
    assert compiled_section.count("| mlp |") == 4
    assert "Recompiles after warm-up: mlp/test-relayout+compile (1)." in compiled_section
    assert 'Compiled O1 (`prepare(level="O1")`) against compiled torch-amp' in compiled_section
    assert "recompiles" in report_module.compiled_text(report)
    assert json.loads(json.dumps(report.to_dict()))["workloads"]["mlp"]["O1+compile"]["recompiles"] == 0


def test_cli_compile_chooses_the_levels(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    from mixprec.bench.runner import COMPILE_MODES, DEFAULT_MODES

    seen: list[BenchConfig] = []

    class StopError(Exception):
        pass

    def capture(config: BenchConfig, **kwargs: Any) -> Any:
        seen.append(config)
        raise StopError

    monkeypatch.setattr("mixprec.bench.runner.run", capture)
    for flags in ([], ["--compile"], ["--compile", "--modes", "fp32,mixprec"], ["--compile-modes", "O2", "--modes",
                  "mixprec"], ["--compile", "--no-fp8-kernels"]):  # fmt: skip
        with pytest.raises(StopError):
            cli.main(["bench", "--quiet", "--out", str(tmp_path), *flags])
    plain, levels, chosen, one, no_kernels = seen
    assert plain.modes == DEFAULT_MODES and not plain.compile and not plain.count_fp8_kernels
    assert levels.modes == ("fp32", *COMPILE_MODES) and levels.compile_modes == COMPILE_MODES
    assert set(COMPILE_MODES) >= {"torch-amp", "O1", "O2", "bf16-sr"} and levels.count_fp8_kernels
    assert chosen.modes == ("fp32", "mixprec") and chosen.compile and chosen.compile_modes is None
    assert one.modes == ("mixprec", "O2") and one.compile and one.compile_modes == ("O2",)
    assert no_kernels.compile and not no_kernels.count_fp8_kernels
    with pytest.raises(ValueError, match="compile mode 'O2' is not among the modes"):
        BenchConfig(modes=("mixprec",), compile=True, compile_modes=("O2",))


INDUCTOR_CODE = """
cpp_fused_abs_amax_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) { }
''')
triton_poi_fused_cast_1 = async_compile.triton('triton_poi_fused_cast_1', '''
def triton_poi_fused_cast_1(in_ptr0, out_ptr0): pass
''')

class Runner:
    def call(self, args):
        buf0 = empty_strided_cpu((), (), torch.float32)
        cpp_fused_abs_amax_0(primals_1, buf0)
        triton_poi_fused_cast_1.run(buf0, buf1, stream=stream0)
        triton_poi_fused_cast_1.run(buf2, buf3, stream=stream0)
        extern_kernels._scaled_mm(buf1, buf3, buf0, buf0, out_dtype=torch.bfloat16, out=buf4)
        extern_kernels.mm(buf4, buf5, out=buf6)
        buf7 = torch.ops.aten.nonzero.default(buf6)
        return (buf4, buf7)
"""


def test_kernel_counts_read_inductors_output_code() -> None:
    from mixprec.bench.kernels import count_code, mixprec_higher

    counted = count_code(INDUCTOR_CODE.replace("    def call(self, args):", "def call(args):"))
    assert counted["kernels"] == 2 and counted["kernel_names"] == ["cpp_fused_abs_amax_0", "triton_poi_fused_cast_1"]
    assert counted["launches"] == 3 and counted["launches_by_kernel"]["triton_poi_fused_cast_1"] == 2
    assert counted["extern"] == {"_scaled_mm": 1, "mm": 1} and counted["fallbacks"] == {"aten.nonzero": 1}
    ours = {"graphs": [{"name": "backward", **counted}]}
    fewer = count_code(INDUCTOR_CODE.replace("        triton_poi_fused_cast_1.run(buf2, buf3, stream=stream0)\n", ""))
    theirs = {"graphs": [{"name": "backward", **fewer}]}
    (line,) = mixprec_higher({"mixprec": ours, "torchao": theirs})
    assert line.startswith("backward: 3 kernel launches against torchao's 2") and "triton_poi_fused_cast_1 x2" in line
    assert mixprec_higher({"mixprec": theirs, "torchao": ours}) == []
    assert mixprec_higher({"mixprec": ours, "torchao": {"error": "torchao is not installed"}}) == []


@pytest.mark.slow  # compiles the same model three ways (about 20 s on 2 cores)
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # Dynamo's own, any Function
def test_fp8_kernel_counts_of_mixprec_and_torchao() -> None:
    from mixprec.bench import report as report_module
    from mixprec.bench.kernels import count_fp8_kernels

    counts = count_fp8_kernels("cpu")
    assert counts["linears"] == 3
    for name in ("mixprec", "torchao"):
        variant = counts["variants"][name]
        assert [g["name"] for g in variant["graphs"]] == ["forward", "backward"], name
        forward, backward = variant["graphs"]
        # three fp8 GEMMs forward, two per linear backward: the code of both graphs was captured
        assert forward["extern"] == {"_scaled_mm": 3} and backward["extern"] == {"_scaled_mm": 6}, name
        assert variant["kernels"] >= 3 and variant["kernels_per_linear"] == variant["kernels"] / 3
    reference = counts["variants"]["O1 (no fp8)"]
    assert "_scaled_mm" not in reference["graphs"][0]["extern"] and sum(reference["graphs"][1]["extern"].values()) == 6
    section = "\n".join(report_module.kernels_markdown(counts))
    assert "| mixprec |" in section and "| torchao |" in section


def test_the_memory_table_gives_bytes_the_largest_model_and_the_loss(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: pathlib.Path) -> None:  # fmt: skip
    modes = "fp32,bf16-sr,bf16-sr-8bit,bf16-sr-8bit-ib"
    assert cli.main(["bench", "--size", "tiny", "--steps", "4", "--workloads", "transformer", "--modes", modes,
                     "--memory-budget", "2MiB", "--quiet", "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "layers" in line}  # fmt: skip
    assert list(rows) == modes.split(",")
    bytes_per_param = [float(row[0]) for row in rows.values()]
    assert bytes_per_param == sorted(bytes_per_param, reverse=True) and bytes_per_param[0] == 16.0
    layers = [int(row[2].split()[0]) for row in rows.values()]
    # less memory a parameter: more layers fit (stepping in backward, the bucket's gradients, up to 1 MiB, wait beside
    # the activations: at this budget they weigh as much as the gradients it frees)
    assert layers[:3] == sorted(layers[:3]) and layers[2] > layers[0] and layers[3] > layers[0]
    report = json.loads((tmp_path / "report.json").read_text())
    loss = report["workloads"]["transformer"]["bf16-sr-8bit-ib"]["final_loss"]
    assert rows["bf16-sr-8bit-ib"][3].startswith(f"{loss:.4f}") and rows["fp32"][3].endswith("(+0.00%)")


def test_the_step_cost_table_counts_and_times_each_recipe() -> None:
    """mixprec bench --step-cost's rows: torch.amp's ratio is 1 by construction, a fused AdamW's step is a couple of
    ops whatever the blocks, bf16-sr's step reads nothing."""
    from mixprec.bench import step_cost

    recipes = [r for r in step_cost.RECIPES if r.name in ("torch-amp", "bf16-sr")]
    rows = step_cost.measure(recipes, ["adamw-fused"], steps=2)
    by_name = {r.recipe: r for r in rows}
    assert set(by_name) == {"torch-amp", "bf16-sr"}
    assert by_name["torch-amp"].vs_torch_amp == 1.0 and by_name["torch-amp"].ops == (2, 2)
    assert by_name["bf16-sr"].ops[0] == by_name["bf16-sr"].ops[1] and by_name["bf16-sr"].host_reads == 0
    assert all(r.step_ms > r.opt_step_ms > 0 for r in rows)
    cells = step_cost.table_rows(rows)
    assert len(cells) == 2 and all(len(c) == len(step_cost.HEADER) for c in cells)


def test_the_step_cost_table_takes_the_recipes_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """--recipes chooses the rows (torch-amp, the baseline, always in), names outside the table are refused with the
    list, and without --step-cost the option is refused."""
    assert cli.main(["bench", "--step-cost", "--recipes", "O2,O3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown O3" in err and "bf16-sr in backward" in err
    assert cli.main(["bench", "--recipes", "O2", "--quiet"]) == 2
    assert "--step-cost" in capsys.readouterr().err
    assert cli.main(["bench", "--step-cost", "--recipes", "O2", "--size", "tiny", "--steps", "1", "--quiet"]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert set(rows) == {"recipe", "torch-amp", "O2"} and rows.count("O2") == 4  # one a form of the optimizer


def test_the_step_cost_table_prints_each_optimizers_rows_as_they_finish(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows are printed per form of the optimizer as measured (one header): stopped in the second form (a GPU
    machine's time limit, Ctrl-C), the first form's rows are out and the message says so."""
    from mixprec.bench import step_cost

    def measure(*args: Any, finished: Any, **kwargs: Any) -> None:
        finished([step_cost.Row("torch-amp", "adamw", (4, 4), 0, 2.0, 1.0, 1.0)])
        finished([step_cost.Row("torch-amp", "adamw-fused", (2, 2), 0, 2.0, 1.0, 1.0)])
        raise KeyboardInterrupt

    monkeypatch.setattr(step_cost, "measure", measure)
    assert cli.main(["bench", "--step-cost", "--recipes", "O2", "--quiet"]) == 130
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[2].strip() for line in lines] == ["optimizer", "adamw", "adamw-fused"]
    assert "interrupted; the rows above were measured" in captured.err


def test_inductors_tf32_hint_is_not_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA inductor warns at each compile of an fp32 matmul that TF32 is off: not a line of the bench's output
    (seen on an H200 in ``bench --llama --compile``); other warnings still are."""
    from mixprec.bench import step_cost

    def measure(*args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. Consider "
            "setting `torch.set_float32_matmul_precision('high')` for better performance.",
            UserWarning,
            stacklevel=1,
        )

    monkeypatch.setattr(step_cost, "measure", measure)
    assert cli.main(["bench", "--step-cost", "--recipes", "O2", "--quiet"]) == 0
    assert "TensorFloat32" not in capsys.readouterr().err
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: warnings.warn("another", UserWarning, stacklevel=1))
    with pytest.raises(UserWarning, match="another"):  # the suite turns warnings into errors: this one is not hidden
        cli.main(["bench", "--step-cost", "--recipes", "O2", "--quiet"])


def test_the_compiled_step_cost_runs_every_recipe_compiled() -> None:
    """Each prepared model compiles graphs of its own on the same frames: past dynamo's default recompile limit (8)
    the later recipes would run eagerly and the compiled table would time them eager. Every recipe of the table
    runs compiled: no frame given up on. Traced with dynamo's eager backend (no inductor: about 10 s)."""
    from mixprec.bench import step_cost

    rows, recompiled, eager = step_cost.measure_compiled(steps=1, backend="eager")
    assert len(rows) == len([r for r in step_cost.RECIPES if not r.step_in_backward]) > 9
    assert eager == 0 and recompiled == 0
