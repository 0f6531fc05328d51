"""tune(): measured recipes on tiny models, the accuracy guard, the budget, recipes as data."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from helpers import Overflowing, square_loss
from mixprec._src.tune.recipe import Measurement, Recipe, Tolerance


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _mlp(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 1))


@pytest.fixture(scope="module")
def planted() -> tuple[Recipe, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Overflowing(), torch.randn(16, 8)
    return mixprec.tune(model, x, square_loss, dtypes=("fp16",), budget_s=30), x


def _output_dtypes(recipe: Recipe, x: torch.Tensor) -> dict[str, torch.dtype]:
    torch.manual_seed(0)
    model = Overflowing()
    run = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen: dict[str, torch.dtype] = {}
    for name, module in run.model.named_children():
        module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    with run.autocast():
        loss = square_loss(run.model(run.inputs(x)))
    run.backward(loss)
    run.step()
    return seen


def test_planted_overflow_keeps_the_module_in_fp32(planted: tuple[Recipe, torch.Tensor]) -> None:
    recipe, x = planted
    assert recipe.dtype is torch.float16, recipe.table()
    assert recipe.keep_fp32 == ("big",)
    assert any("diagnose(fp16) keeps big" in n for n in recipe.notes)
    chosen = [m for m in recipe.measurements if m.status == "chosen"]
    assert len(chosen) == 1 and chosen[0].name == recipe.name and chosen[0].loss_err is not None
    dtypes = _output_dtypes(recipe, x)
    assert dtypes["big"] is torch.float32
    # the other modules compute in fp16 unless the search moved linear to fp32 (at any level), or the
    # per-layer plan moved the layer (here, where fp16 matmuls are emulated, to fp32)
    fp16_inp = recipe.policy("cpu").category_of("linear") is mixprec.OpCategory.LOWER
    fp16_inp = fp16_inp and "inp" not in {c.name for c in recipe.moved_layers}
    assert (dtypes["inp"] is torch.float16) == fp16_inp, recipe.table()
    plain = next(m for m in recipe.measurements if m.name == "fp16 O1")
    assert plain.status == "rejected" and ("nan" in plain.reason or "inf" in plain.reason), plain


def test_recipe_round_trips_through_json_and_applies_to_a_fresh_model(
    planted: tuple[Recipe, torch.Tensor], tmp_path: Any
) -> None:
    recipe, x = planted
    again = Recipe.from_json(recipe.to_json())
    assert again == recipe
    recipe.to_json(str(tmp_path / "recipe.json"))
    assert Recipe.from_json(str(tmp_path / "recipe.json")) == recipe
    assert _output_dtypes(again, x) == _output_dtypes(recipe, x)
    model = Overflowing()
    assert isinstance(again.apply(model, torch.optim.SGD(model.parameters(), lr=0.1)).scaler, mixprec.GradScaler)
    assert recipe.name in recipe.table() and "vs torch.amp" in recipe.table()


@pytest.mark.parametrize(
    ("strict", "reason"),
    [(Tolerance(loss_rtol=0.0, grad_cos=-1.0, update_cos=-1.0), "loss differs from fp32"),
     (Tolerance(loss_rtol=1e9, grad_cos=1.0, update_cos=-1.0), "gradient cosine"),
     (Tolerance(loss_rtol=1e9, grad_cos=-1.0, update_cos=1.0), "update cosine")],
    ids=["loss", "gradients", "updates"],
)  # fmt: skip
def test_a_candidate_outside_the_tolerance_is_rejected_with_its_reason(strict: Tolerance, reason: str) -> None:
    """Each guard on its own (the others wide open) rejects every low-precision candidate: only fp32 passes."""
    model, x = _mlp(), torch.randn(32, 8)
    recipe = mixprec.tune(model, x, square_loss, tolerance=strict, budget_s=30)
    low = [m for m in recipe.measurements if not m.name.startswith("fp32") and m.status != "not measured"]
    assert low and all(m.status == "rejected" for m in low), recipe.table()
    assert all(reason in m.reason for m in low), recipe.table()
    assert recipe.dtype is torch.float32
    assert any("torch.amp's default fails the accuracy guard" in n for n in recipe.notes)


def test_nothing_beats_the_default_returns_torch_default() -> None:
    model, x = _mlp(), torch.randn(32, 8)
    recipe = mixprec.tune(model, x, square_loss, dtypes=("bf16",), min_speedup=100.0, budget_s=30)
    assert recipe.is_torch_default and recipe == Recipe(dtype=torch.bfloat16, measurements=recipe.measurements,
                                                        notes=recipe.notes, measured_on=recipe.measured_on,
                                                        tuning_s=recipe.tuning_s, layers=recipe.layers,
                                                        timing_noise=recipe.timing_noise)  # fmt: skip
    assert any(n.startswith("nothing beat torch.amp's default") for n in recipe.notes)
    assert "(torch.amp's default)" in recipe.table()
    assert not any("bf16-pure" in m.name for m in recipe.measurements)  # searched only when asked for


def _timed(func: Callable[..., Any], spans: list[tuple[float, float]]) -> Callable[..., Any]:
    """``func``, recording when each call began and ended."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            spans.append((begin, time.perf_counter()))

    return timed


def test_tune_respects_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps of about the same length on every CPU: the model is tiny (its step computes for milliseconds,
    # even where bf16 matmuls are emulated) and the loss sleeps 0.1 s. Round 1 takes 12 steps
    # (at least 8 if it stops slow candidates), the profile 2 and round 3 more, so a whole search cannot fit
    # in 1 s anywhere, while round 1's first 6 steps (its accuracy checks) usually do: then the budget also
    # stops the search between rounds. A step past the budget is short everywhere.
    from mixprec._src.tune import probes, trial
    from mixprec._src.tune import search as tune_module

    steps: list[tuple[float, float]] = []
    diagnoses: list[tuple[float, float]] = []
    monkeypatch.setattr(trial.Trial, "step", _timed(trial.Trial.step, steps))
    monkeypatch.setattr(tune_module, "diagnose", _timed(tune_module.diagnose, diagnoses))
    # As on a CPU with bf16 and fp16 instructions: the candidates run, so the budget is what stops them.
    monkeypatch.setattr(probes, "matmul_slowdown", lambda dtype, device: 1.0)

    def slow_loss(out: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return square_loss(out)

    budget = 1.0
    start = time.perf_counter()
    recipe = mixprec.tune(_mlp(), torch.randn(32, 8), slow_loss, budget_s=budget)
    elapsed = time.perf_counter() - start
    # said in the notes: the search's own note, or the per-layer plan's where it moved a layer it then could not race
    said = ("left out work that would not have ended inside the budget", "budget ran out")
    assert any(words in n for n in recipe.notes for words in said), recipe.notes
    # the search stops between steps: none starts past the budget (so one step at most ends past it) ...
    assert steps and all(begin < start + budget for begin, _ in steps), [b - start for b, _ in steps]
    # ... a diagnosis starts only if it should end inside the budget ...
    assert all(end < start + budget + 0.5 for _, end in diagnoses), [e - start for _, e in diagnoses]
    # ... and nothing else runs long past it: one step at most, and the bookkeeping
    longest = max(end - begin for begin, end in steps)
    assert elapsed < budget + longest + 0.5, (elapsed, longest)
    assert any(m.status == "not measured" or m.reason == "the budget ran out" for m in recipe.measurements) or (
        len(recipe.measurements) < 4
    )


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        copy.deepcopy(optimizer.state_dict()),
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        [id(p) for p in model.parameters()],
        [p.dtype for p in model.parameters()],
        torch.get_rng_state(),
        model.training,
    )


def test_user_model_and_optimizer_are_unchanged() -> None:
    torch.manual_seed(0)
    model = SmallConvNet()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()  # state and gradients to keep
    before = _snapshot(model, optimizer)
    recipe = mixprec.tune(
        model, x, torch.nn.functional.cross_entropy, targets=y, optimizer=optimizer, dtypes=("bf16",), budget_s=30
    )
    after = _snapshot(model, optimizer)
    assert any(m.name.endswith("channels_last") for m in recipe.measurements)  # the conv model tried the layout
    weights, opt_state, grads, ids, dtypes, rng, training = before
    assert weights.keys() == after[0].keys() and all(torch.equal(weights[k], after[0][k]) for k in weights)
    assert str(opt_state) == str(after[1])  # tensors print in full at this size
    assert all(torch.equal(g, h) for g, h in zip(grads, after[2], strict=True))
    assert (ids, dtypes, training) == (after[3], after[4], after[6]) and torch.equal(rng, after[5])
    assert model.conv.weight.is_contiguous()  # channels_last was tried on copies only


def _prepared() -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
    model = _mlp()
    mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O1")
    return model, torch.randn(4, 8), {}


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("meta batch", "on meta but the model is on cpu"),
        ("vector loss", "scalar"),
        ("prepared", "prepared by mixprec.prepare"),
        ("zero budget", "budget_s must be a positive"),
    ],
)
def test_bad_input_gives_a_clear_error(case: str, match: str) -> None:
    model, x, kwargs = _mlp(), torch.randn(4, 8), {"budget_s": 5.0}
    loss: Any = square_loss
    if case == "meta batch":
        x = torch.randn(4, 8, device="meta")
    elif case == "vector loss":
        loss = lambda out: out.float().square()  # noqa: E731
    elif case == "prepared":
        model, x, _ = _prepared()
    else:
        kwargs = {"budget_s": 0}
    with pytest.raises(ValueError, match=match):
        mixprec.tune(model, x, loss, **kwargs)


def test_recipe_validation_and_layout() -> None:
    with pytest.raises(ValueError, match="op moves"):
        Recipe(level="O2", fp32_ops=("scaled_dot_product_attention",))
    with pytest.raises(ValueError, match="unknown layout"):
        Recipe(layout="nhwc")
    with pytest.raises(ValueError, match="unknown level"):
        Recipe(level="O3")
    with pytest.raises(ValueError, match="unknown recipe fields"):
        Recipe.from_json('{"dtype": "bf16", "speed": 2}')
    recipe = Recipe(dtype="bf16", fp32_ops=(torch.nn.functional.scaled_dot_product_attention,), layout="channels_last")
    assert recipe.fp32_ops == ("scaled_dot_product_attention",)
    assert recipe.policy("cuda").category_of("scaled_dot_product_attention") is mixprec.OpCategory.FP32
    model = SmallConvNet()
    run = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert run.inputs(torch.randn(2, 3, 8, 8)).is_contiguous(memory_format=torch.channels_last)
    assert run.scaler is None
    mlp = _mlp()
    o2 = dataclasses.replace(Recipe(dtype="bf16"), level="O2").apply(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1))
    seen = []
    mlp[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    mlp(torch.randn(2, 8))
    assert o2.model is mlp and seen == [torch.bfloat16] and hasattr(mlp, "_mixprec")


def test_bench_mode_tunes_each_workload_first() -> None:
    from mixprec.bench import BenchConfig, run

    report = run(BenchConfig(workloads=("mlp",), modes=("torch-amp", "mixprec-tuned"), steps=3, warmup=1, size="tiny",
                             tune_budget_s=5.0))  # fmt: skip
    tuned = report.results["mlp"]["mixprec-tuned"]
    assert tuned.tuning_s is not None and 0 < tuned.tuning_s < 5.0 + 2.0
    assert tuned.recipe and tuned.recipe.split()[0] in ("bf16", "fp32")  # the bench's dtype or fp32
    assert report.results["mlp"]["torch-amp"].tuning_s is None and tuned.vs_torch_amp is not None


def test_cli_tune_writes_the_recipe(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec import cli

    out = tmp_path / "recipe.json"
    assert cli.main(["tune", "--workload", "mlp", "--size", "tiny", "--budget", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mixprec tune: round 1 (dtype)" in text and "recipe: " in text and "vs torch.amp" in text
    recipe = Recipe.from_json(str(out))
    assert recipe.measurements and recipe.tuning_s > 0
    assert "per-layer plan:" in text and recipe.layers  # the plan, printed and saved
    assert cli.main(["tune", "--workload", "mlp", "--size", "tiny", "--budget", "5", "--no-per-layer", "--out",
                     str(out)]) == 0  # fmt: skip
    assert "per-layer plan:" not in capsys.readouterr().out and not Recipe.from_json(str(out)).layers
    assert cli.main(["tune", "--model", "tests.test_tune:_mlp"]) == 2
    assert "--model needs --batch" in capsys.readouterr().err
    assert cli.main(["tune", "--workload", "mlp", "--size", "tiny", "--levels", "O4"]) == 2
    assert "unknown level 'O4'" in capsys.readouterr().err


class _FailsWithBf16Weights(nn.Module):
    """Trains in fp32 and at O1/O2 (weights stay fp32 outside their own forward); raises at bf16 levels."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lin.weight.dtype is torch.bfloat16:
            raise AttributeError("'Tensor' object has no attribute 'loss'")  # what a broken candidate raises
        return self.lin(x)


def test_a_candidate_that_raises_is_rejected_with_its_reason_not_fatal() -> None:
    torch.manual_seed(0)
    recipe = mixprec.tune(_FailsWithBf16Weights(), torch.randn(16, 8), square_loss, dtypes=("bf16",),
                          levels=("O1", "O2", "bf16-sr"), budget_s=60)  # fmt: skip
    failed = [m for m in recipe.measurements if "bf16-sr" in m.name]
    assert failed and all("AttributeError" in m.reason for m in failed), recipe.table()
    assert recipe.level != "bf16-sr"


def test_tune_prints_nothing_from_the_profiler(capfd: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    mixprec.tune(_mlp(), torch.randn(32, 8), square_loss, dtypes=("bf16",), budget_s=30)
    captured = capfd.readouterr()
    assert "profiler_start" not in captured.err + captured.out
    import sys

    print("still here", file=sys.stderr)  # stderr works again afterwards
    assert "still here" in capfd.readouterr().err


def test_the_finalists_race_head_to_head_before_the_choice() -> None:
    # Rounds run apart: a step's time drifts between them on a shared machine. The fastest candidates
    # and torch.amp's default race again in one round; only that round's ms/step are shown.
    recipe = mixprec.tune(_mlp(), torch.randn(32, 8), square_loss, dtypes=("bf16", "fp32"), budget_s=60)
    assert any("raced head to head" in n for n in recipe.notes), recipe.notes
    timed = [m for m in recipe.measurements if m.step_ms is not None]
    assert 2 <= len(timed) <= 5, recipe.table()  # the default and at most four finalists
    default = next(m for m in timed if m.name == Recipe(dtype=torch.bfloat16).name)
    assert default.vs_default == 1.0
    for m in timed:  # one round's figures: each ratio is the default's time over its own
        assert m.vs_default is not None and m.step_ms is not None
        assert m.vs_default == pytest.approx(default.step_ms / m.step_ms, rel=1e-9), recipe.table()
    chosen = next(m for m in recipe.measurements if m.status == "chosen")
    assert chosen.step_ms is not None, recipe.table()  # the choice is made on the head-to-head figures


def test_a_dtype_emulated_here_is_rejected_without_spending_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CPU without bf16/fp16 instructions torch emulates them, 10-100x slower than fp32: one step of a
    # real model can take minutes. tune measures a matmul in each dtype first and does not start a step
    # that would end past the budget. (Planted here: the probe reports a 1000x slowdown for low dtypes.)
    from mixprec._src.tune import probes

    monkeypatch.setattr(probes, "matmul_slowdown", lambda dtype, device: 1000.0)

    def slow_loss(out: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)  # a forward of 20 ms: a low-precision step would take about a minute
        return square_loss(out)

    start = time.perf_counter()
    recipe = mixprec.tune(_mlp(), torch.randn(32, 8), slow_loss, budget_s=5)
    assert time.perf_counter() - start < 5, recipe.table()
    assert recipe.dtype is torch.float32, recipe.table()
    low = [m for m in recipe.measurements if m.name.startswith(("bf16", "fp16"))]
    assert low and all("emulated on this device" in m.reason for m in low), recipe.table()
    assert any(n.startswith("torch.amp's default is too slow here") for n in recipe.notes), recipe.notes


def test_a_plain_recipe_at_another_dtype_is_not_called_torch_amps_default() -> None:
    # The table compares with torch.amp at the device's dtype (bf16 O1 on a CPU); a plain fp16 O1 recipe
    # chosen against it is plain torch.autocast in fp16, not "torch.amp's default".
    measured = (Measurement("bf16 O1", "passed", 10.0, 1.0), Measurement("fp16 O1", "chosen", 8.0, 1.25))
    fp16 = Recipe(dtype=torch.float16, measurements=measured)
    assert "(torch.amp's default)" not in fp16.table()
    assert "recipe: fp16 O1 (plain torch.autocast in fp16; the table's torch.amp baseline is bf16 O1)" in fp16.table()
    assert "recipe: bf16 O1 (torch.amp's default)" in Recipe(dtype=torch.bfloat16, measurements=measured).table()


class _NoisyClock:
    """A clock for step timing whose every reading adds 0-30 ms (seeded): every candidate measures the same
    speed on average, with a spread far above a real machine's; the deadline still reads real time."""

    def __init__(self, seed: int = 0) -> None:
        import random

        self.rng, self.offset, self.calls = random.Random(seed), 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        self.offset += self.rng.uniform(0.0, 0.03)
        return time.perf_counter() + self.offset


def test_a_noisy_machine_is_measured_repeated_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec._src import timing

    clock = _NoisyClock()
    monkeypatch.setattr(timing, "clock", clock)
    recipe = mixprec.tune(_mlp(), torch.randn(32, 8), square_loss, dtypes=("bf16", "fp32"), budget_s=60)
    assert clock.calls > 0
    assert recipe.timing_noise is not None and recipe.timing_noise > 0.1, recipe.table()
    assert any("timing noise" in n and "the machine is busy" in n and "took up to 8 steps" in n
               for n in recipe.notes), recipe.notes  # fmt: skip
    timed = [m for m in recipe.measurements if m.vs_default is not None]
    assert timed and all(m.noise is not None and m.noise > 0 for m in timed), recipe.table()
    assert " ±" in recipe.table()  # each speed with its noise
    chosen = next(m for m in recipe.measurements if m.status == "chosen")
    if chosen.name != Recipe(dtype=torch.bfloat16).name:  # a choice beyond the noise, never within it
        assert chosen.vs_default is not None and chosen.noise is not None
        assert chosen.vs_default >= 1 + chosen.noise, recipe.table()
    for layer in recipe.layers:  # the per-layer plan's timings are as noisy, and repeated too
        assert layer.noise > 0.05, layer
    assert Recipe.from_json(recipe.to_json()).timing_noise == recipe.timing_noise


def _search_with(results: dict[str, Measurement]) -> Any:
    from mixprec._src.tune import rounds

    search = rounds.Search.__new__(rounds.Search)
    search.results = dict(results)
    search.recipes = {"bf16 O1": Recipe(dtype=torch.bfloat16), "bf16 O2": Recipe(dtype=torch.bfloat16, level="O2")}
    search.out_of_time, search.repeated = False, 8
    return search


@pytest.mark.parametrize("noise, chosen", [(0.15, "bf16 O1"), (0.01, "bf16 O2")])
def test_a_speedup_within_its_noise_keeps_torch_amps_default(noise: float, chosen: str) -> None:
    from mixprec._src.tune import rounds as tune_rounds

    results = {"bf16 O1": Measurement("bf16 O1", "passed", 10.0, 1.0, noise=0.1),
               "bf16 O2": Measurement("bf16 O2", "passed", 9.26, 1.08, noise=noise)}  # fmt: skip
    recipe = tune_rounds.choose(_search_with(results), "bf16 O2", Recipe(dtype=torch.bfloat16), [torch.bfloat16],
                                 1.02, [], None)  # fmt: skip
    assert recipe.name == chosen
    within = [n for n in recipe.notes if "within the noise of its measurements (±15%)" in n]
    assert bool(within) == (chosen == "bf16 O1"), recipe.notes
    assert recipe.timing_noise == pytest.approx((0.1 + noise) / 2)


def test_when_the_default_is_fastest_no_other_recipe_is_called_chosen() -> None:
    from mixprec._src.tune import rounds as tune_rounds

    results = {"bf16 O1": Measurement("bf16 O1", "passed", 10.0, 1.0, noise=0.01),
               "bf16 O2": Measurement("bf16 O2", "passed", 10.1, 0.99, noise=0.01)}  # fmt: skip
    recipe = tune_rounds.choose(_search_with(results), "bf16 O1", Recipe(dtype=torch.bfloat16), [torch.bfloat16],
                                 1.02, [], None)  # fmt: skip
    assert recipe.name == "bf16 O1"
    assert not any("simpler: chosen" in n for n in recipe.notes), recipe.notes


def test_a_trial_and_a_reference_of_different_lengths_are_judged_on_the_steps_both_ran() -> None:
    """On a slow or loaded machine a trial and its fp32 reference end a round with different numbers of losses:
    judge compares the steps both ran, and one with none in common is not judged (no traceback)."""
    from types import SimpleNamespace

    from mixprec._src.tune.trial import judge

    grad, update = torch.ones(4), torch.ones(4)
    tol = mixprec.Tolerance()
    ref = SimpleNamespace(losses=[2.0, 1.0], grad=grad, update=update)
    close = SimpleNamespace(losses=[2.0, 1.0, 0.5], grad=grad, update=update)
    err, gcos, ucos, why = judge(close, ref, tol)  # type: ignore[arg-type]
    assert (err, why) == (0.0, "") and gcos == pytest.approx(1.0) and ucos == pytest.approx(1.0)
    far = SimpleNamespace(losses=[4.0], grad=grad, update=update)
    assert judge(far, ref, tol)[0] == 1.0  # type: ignore[arg-type]
    none = SimpleNamespace(losses=[1.0], grad=grad, update=update)
    unfinished = SimpleNamespace(losses=[], grad=None, update=None)
    assert judge(none, unfinished, tol)[3].startswith("not judged")  # type: ignore[arg-type]


def test_a_round_whose_fp32_reference_did_not_finish_reports_its_trials_as_not_measured() -> None:
    """The crash a new user met in make demo (zip() of a trial's losses and a shorter reference's): the trial is
    reported, not raised."""
    from types import SimpleNamespace

    from mixprec._src.tune.rounds import Search

    def trial(name: str, losses: list[float]) -> Any:
        return SimpleNamespace(name=name, recipe=None, failed="", stopped="", checked=len(losses) == 3, times=[0.01],
                               losses=losses, grad=torch.ones(2), update=torch.ones(2), median_s=lambda: 0.01,
                               noise=lambda default: None)  # fmt: skip

    search = Search(nn.Linear(2, 2), None, None, None, torch.device("cpu"), mixprec.Tolerance(), 0.0, None)  # type: ignore[arg-type]
    search.ref = trial("fp32", [1.0])
    candidate = trial("bf16", [1.0, 0.9, 0.8])
    search.record(candidate, candidate, 0.01)  # type: ignore[arg-type]
    result = search.results["bf16"]
    assert result.status == "not measured" and "fp32 reference did not finish" in result.reason


def test_a_row_stopped_early_and_one_over_the_memory_budget_say_so_without_contradiction() -> None:
    """A candidate stopped to save the budget names the figure it was stopped at as the default's first steps' (the
    column divides by all of them); one over the memory budget says so with its bytes, the fp32 reference too."""
    from types import SimpleNamespace

    from mixprec._src.tune.rounds import SLOW, Search

    def trial(name: str, seconds: list[float]) -> Any:
        return SimpleNamespace(name=name, recipe=SimpleNamespace(name=name), failed="", stopped="", checked=True,
                               times=seconds, losses=[1.0, 0.9, 0.8], grad=torch.ones(2), update=torch.ones(2),
                               median_s=lambda: sorted(seconds)[len(seconds) // 2],
                               noise=lambda default: None)  # fmt: skip

    search = Search(nn.Linear(2, 2), None, None, None, torch.device("cpu"), mixprec.Tolerance(), 0.0, None)  # type: ignore[arg-type]
    default, slow = trial("bf16", [0.01, 0.01, 0.01]), trial("fp16", [SLOW * 0.02] * 3)
    search.ref = trial("fp32", [0.02] * 3)
    search._stop_slow(default, [default, slow])  # type: ignore[arg-type]
    assert slow.stopped == "0.33x torch.amp's default's first 3 steps"
    search.record(slow, default, 0.01)  # type: ignore[arg-type]
    assert search.results["fp16"].reason == f"stopped early to save the budget: it ran at {slow.stopped}"
    search.fit = SimpleNamespace(
        fits=lambda recipe: recipe.name != "fp32", describe=lambda r: f"{r.name} needs 2.51 MiB"
    )
    search.record(search.ref, default, 0.01)  # type: ignore[arg-type]
    assert (
        search.results["fp32"].reason == "the fp32 reference; over the memory budget: fp32 needs 2.51 MiB, never chosen"
    )
