"""mixprec bench --llama: a config-built Llama trained at each level (tiny on the CPU; the 1.1B size on a GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import requires_cuda
from mixprec import cli
from mixprec.bench import llama


@pytest.fixture(scope="module")
def tiny_rows() -> dict[str, llama.LlamaRow]:
    return {row.recipe: row for row in llama.measure(size="tiny", steps=2)}


def test_each_recipe_trains_at_its_level(tiny_rows: dict[str, llama.LlamaRow]) -> None:
    """The bytes each recipe holds between steps say it trained at its level: torch.amp 16 a parameter (fp32
    weight, gradient and two moments), O2 18 (its bf16 copies besides), bf16-pure 8 (all in bf16), to a tenth."""
    assert list(tiny_rows) == [r.name for r in llama.RECIPES]
    n = llama.SIZES["tiny"].parameters()
    assert n == sum(p.numel() for p in llama.llama(llama.SIZES["tiny"]).parameters())
    # rounded: the norms' weights are kept in fp32 at every level, and the step counts take 4 bytes a tensor
    held = {name: round(row.held_bytes / n, 1) for name, row in tiny_rows.items()}
    assert held["torch-amp"] == held["O1"] == held["O1+fp8"] == 16
    assert held["O2"] == 18 and held["bf16-pure"] == 8
    assert all(row.peak_bytes is None for row in tiny_rows.values())  # the CPU has no allocator statistics


def test_rows_say_tokens_a_second_and_the_ratio_to_their_baseline(tiny_rows: dict[str, llama.LlamaRow]) -> None:
    shape = llama.SIZES["tiny"]
    for row in tiny_rows.values():
        assert (row.batch, row.seq) == (shape.batch, shape.seq) and not row.compiled
        assert row.tokens_per_s == pytest.approx(row.batch * row.seq / (row.step_ms / 1e3))
        assert 0 < row.loss < 7  # near ln(256) from random tokens, finite
        baseline = tiny_rows[row.baseline]
        if row.recipe == row.baseline:
            assert row.vs_baseline is None
        else:
            assert row.vs_baseline == pytest.approx(baseline.step_ms / row.step_ms)
    assert tiny_rows["O1+fp8"].baseline == "O1" and tiny_rows["O2"].baseline == "torch-amp"
    cells = llama.table_row(tiny_rows["O1+fp8"])
    assert len(cells) == len(llama.HEADER) and cells[5].endswith("x O1") and cells[7] == "-"


def test_the_model_is_built_the_same_each_time() -> None:
    """The build is seeded: two builds hold the same weights, so runs (and sessions) compare."""
    first = [llama.llama(llama.SIZES["tiny"]).model.embed_tokens.weight for _ in range(2)]
    assert torch.equal(first[0], first[1])


def test_the_cli_prints_the_recipes_asked_for_with_their_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--llama", "--size", "tiny", "--steps", "1", "--quiet", "--device", "cpu"]
    assert cli.main([*args, "--recipes", "O1+fp8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows == ["recipe", "torch-amp", "O1", "O1+fp8"]  # torch-amp always, O1 as fp8's baseline
    assert "emulated in fp32 on a CPU" in out
    assert cli.main([*args, "--recipes", "O1+fp8,bf16-pure,O2"]) == 0  # the baselines first, then as asked
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows == ["recipe", "torch-amp", "O1", "O1+fp8", "bf16-pure", "O2"]
    assert cli.main([*args, "--recipes", "O3"]) == 2
    assert "unknown O3" in capsys.readouterr().err
    assert cli.main([*args, "--batch", "0"]) == 2
    assert cli.main(["bench", "--batch", "2", "--quiet"]) == 2
    assert "--llama" in capsys.readouterr().err
    assert cli.main(["bench", "--llama", "--step-cost", "--quiet"]) == 2


def test_the_batch_is_the_sizes_on_the_cpu() -> None:
    shape = llama.SIZES["tiny"]
    assert llama.fit_batch(llama.llama(shape), shape, torch.device("cpu"), llama.RECIPES) == shape.batch


@requires_cuda
def test_on_a_gpu_the_batch_is_fitted_and_the_peak_measured() -> None:
    """On CUDA the batch is the largest that fits (the tiny Llama: 16) and each row has its own peak, O2's above
    bf16-pure's (fp32 masters and gradients)."""
    rows = {r.recipe: r for r in llama.measure(size="tiny", steps=1, device="cuda")}
    assert all(r.batch == 16 and r.peak_bytes is not None and r.peak_bytes > 0 for r in rows.values())
    assert rows["O2"].peak_bytes > rows["bf16-pure"].peak_bytes  # type: ignore[operator]
