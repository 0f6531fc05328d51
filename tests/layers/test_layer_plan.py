"""tune's per-layer plan: measurements per layer and precision, the choice rule, the recipe that applies it."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from helpers import requires_cuda, square_loss
from mixprec import Recipe
from mixprec._src.layers import choice as layer_choice
from mixprec._src.layers import plan as layer_plan
from mixprec._src.layers.choice import LayerChoice, Measured
from mixprec._src.tune import tables as reporting


def _measured(name: str, ms: dict[str, float], sqnr: dict[str, float]) -> Measured:
    return Measured(name, "linear 4096->4096, 8192 rows", ms, sqnr, {})


def test_the_fastest_precision_above_the_floor_is_chosen() -> None:
    fast_fp8 = _measured("big", {"fp32": 9.0, "bf16": 3.0, "fp8-tensorwise": 1.6, "fp8-rowwise": 1.8},
                         {"bf16": 45.0, "fp8-tensorwise": 27.0, "fp8-rowwise": 28.0})  # fmt: skip
    noisy_fp8 = _measured("noisy", {"fp32": 9.0, "bf16": 3.0, "fp8-tensorwise": 1.6, "fp8-rowwise": 1.8},
                          {"bf16": 45.0, "fp8-tensorwise": 12.0, "fp8-rowwise": 22.0})  # fmt: skip
    slow_fp8 = _measured("small", {"fp32": 0.2, "bf16": 0.1, "fp8-tensorwise": 0.15},
                         {"bf16": 45.0, "fp8-tensorwise": 27.0})  # fmt: skip
    bad_bf16 = _measured("outliers", {"fp32": 1.0, "bf16": 0.5}, {"bf16": 8.0})
    near = _measured("near", {"fp32": 1.0, "bf16": 0.99}, {"bf16": 45.0})
    big, noisy, small, outliers, close = layer_choice.choose([fast_fp8, noisy_fp8, slow_fp8, bad_bf16, near],
                                                           "bf16", 20.0, 1.02)  # fmt: skip
    assert big.choice == "fp8-tensorwise" and "fastest above 20 dB (1.88x faster than bf16)" in big.reason
    assert noisy.choice == "fp8-rowwise" and "not fp8-tensorwise 12.0 dB < 20 dB" in noisy.reason
    assert small.choice == "bf16" and "fp8-tensorwise not faster than bf16 (0.150 vs 0.100 ms)" in small.reason
    assert outliers.choice == "fp32" and "bf16 8.0 dB < 20 dB" in outliers.reason
    assert close.choice == "bf16" and close.reason.startswith("as the recipe has it")  # not 2% slower than fp32
    assert layer_choice.choose([fast_fp8], "bf16", 20.0, 1.02, fp8_allowed=False)[0].choice == "bf16"
    # an fp32 recipe: a layer moves to bf16 only if 1.02x faster
    assert [c.choice for c in layer_choice.choose([near, bad_bf16], "fp32", 20.0, 1.02)] == ["fp32", "fp32"]
    assert layer_choice.choose([_measured("x", {"fp32": 1.0, "bf16": 0.5}, {"bf16": 40.0})], "fp32", 20.0,
                             1.02)[0].choice == "bf16"  # fmt: skip


@pytest.mark.parametrize("noise, choice", [(0.15, "bf16"), (0.01, "fp16")])
def test_a_layer_faster_within_its_timing_noise_stays_as_the_recipe_has_it(noise: float, choice: str) -> None:
    m = Measured("attn.q", "linear 64->64, 512 rows", {"fp32": 2.0, "bf16": 1.08, "fp16": 1.0},
                 {"bf16": 40.0, "fp16": 50.0}, {}, noise)  # fmt: skip
    (layer,) = layer_choice.choose([m], "bf16", 20.0, 1.02)
    assert layer.choice == choice and layer.noise == noise
    assert ("fp16 measured 1.08x faster, within the timing noise ±15%" in layer.reason) == (choice == "bf16")


def test_a_layers_noisy_timings_are_repeated_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from mixprec._src import timing

    rng, readings = random.Random(0), [0.0]

    def noisy() -> float:  # the whole clock is fake: a run reads 1 ms and 0-20 ms of noise, on any machine
        readings.append(readings[-1] + 0.001 + rng.uniform(0.0, 0.02))
        return readings[-1]

    monkeypatch.setattr(timing, "clock", noisy)
    measured, _ = layer_plan.measure(_Net(), torch.randn(4, 4, 24), square_loss, ["bf16"], time.perf_counter() + 60)
    runs = (len(readings) - 1) // 2  # two readings a run
    assert runs > len(measured) * 2 * (1 + layer_plan._REPS)  # fp32 and bf16: a warm-up, then repeated past 3
    assert runs <= len(measured) * 2 * (1 + layer_plan._MAX_REPS)
    assert all(m.noise > timing.NOISY for m in measured)
    assert [c.noise for c in layer_choice.choose(measured, "bf16", 20.0, 1.02)] == [m.noise for m in measured]


@pytest.mark.parametrize("width", [80, 100, 140])
def test_the_layer_table_fits_the_terminal_and_loses_nothing(width: int) -> None:
    names = [f"bert.encoder.layer.{i}.attention.self.{k}" for i in range(12) for k in ("query", "key", "value")]
    reason = ("fastest above 20 dB (1.70x faster than bf16); not fp8-rowwise 12.0 dB < 20 dB; fp8-tensorwise, "
              "fp8-rowwise not timed: fp8 GEMMs emulated on cpu")  # fmt: skip
    ms = {"fp32": 1.234, "bf16": 0.51, "fp16": 0.48, "fp8-tensorwise": 0.3, "fp8-rowwise": 0.31}
    db = {"bf16": 38.2, "fp16": 51.0, "fp8-tensorwise": 26.9, "fp8-rowwise": 12.0}
    layers = [LayerChoice(n, "linear 768->768, 4096 rows", ms, db, "bf16", f"{reason} ({n})") for n in names]
    text = reporting.layer_table(layers, width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    rows = [line for line in lines if line.split("  ")[0].strip().endswith(("query", "key", "value"))]
    assert len(rows) == len(names) and len({r.split()[0] for r in rows}) == len(names)  # each name still its own
    assert all("0.510/38" in r and "0.300/27" in r for r in rows)
    flat = " ".join(" ".join(lines).split())
    for name in names:  # every reason whole, wrapped under its row
        assert " ".join(f"linear 768->768, 4096 rows: {reason} ({name})".split()) in flat
    if width >= 140:
        assert all(n in text for n in names)  # names shortened only where they do not fit
    recipe = Recipe(dtype="bf16", layers=tuple(layers))
    assert Recipe.from_json(recipe.to_json()).layers == recipe.layers  # the full data


_PRECISIONS = ("fp32", "bf16", "fp16", "fp8-tensorwise", "fp8-rowwise")


@settings(max_examples=200, deadline=None)
@given(ms=st.lists(st.floats(0.01, 100.0), min_size=5, max_size=5),
       db=st.lists(st.floats(0.0, 80.0), min_size=4, max_size=4),
       default=st.sampled_from(("fp32", "bf16", "fp16")), floor=st.floats(0.0, 60.0), fp8=st.booleans())  # fmt: skip
def test_the_choice_is_allowed_fast_and_stays_put_within_noise(ms: list[float], db: list[float], default: str,
                                                               floor: float, fp8: bool) -> None:  # fmt: skip
    m = _measured("x", dict(zip(_PRECISIONS, ms, strict=True)), dict(zip(_PRECISIONS[1:], db, strict=True)))
    (choice,) = layer_choice.choose([m], default, floor, 1.02, fp8_allowed=fp8)
    p = choice.choice
    assert p == "fp32" or m.sqnr_db[p] >= floor  # never below the floor
    if p.startswith("fp8"):
        assert fp8 and m.ms[p] < m.ms["bf16"]  # never fp8 where bf16 is as fast
    allowed = [q for q in _PRECISIONS if q == "fp32" or (m.sqnr_db[q] >= floor and (not q.startswith("fp8") or (
        fp8 and m.ms[q] < m.ms["bf16"])))]  # fmt: skip
    fastest = min(m.ms[q] for q in allowed)
    if default in allowed and m.ms[default] <= 1.02 * fastest:
        assert p == default  # no move within the noise
    else:
        assert m.ms[p] == fastest


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.up = nn.Linear(16, 64)
        self.odd = nn.Linear(64, 40)
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).transpose(1, 2)
        return self.head(torch.relu(self.odd(torch.relu(self.up(h)))))


def test_measure_times_each_called_layer_at_its_shapes_and_skips_emulated_fp8() -> None:
    model, x = _Net(), torch.randn(4, 4, 24)
    measured, notes = layer_plan.measure(model, x, square_loss, ["bf16", "fp16", *layer_plan.FP8_CANDIDATES],
                                         time.perf_counter() + 60)  # fmt: skip
    assert [m.name for m in measured] == ["conv", "up", "odd", "head"]  # in call order; unused is not called
    assert measured[0].shape == "conv1d 4->16 k3, input (4, 4, 24)" and measured[1].shape == "linear 16->64, 96 rows"
    assert any("no layer in fp8: fp8 GEMMs are emulated on cpu" in n for n in notes)
    for m in measured:
        assert set(m.ms) == {"fp32", "bf16", "fp16"} and all(v > 0 for v in m.ms.values())
        assert 25 < m.sqnr_db["bf16"] < 70 and m.sqnr_db["fp16"] > m.sqnr_db["bf16"]  # 8 vs 11 mantissa bits
    up = measured[1]  # fp8 is not timed here, but its error is what a GPU's would be
    assert 18 < up.sqnr_db["fp8-tensorwise"] < up.sqnr_db["bf16"] and "fp8-rowwise" in up.sqnr_db
    assert up.not_measured["fp8-tensorwise"] == "fp8 GEMMs emulated on cpu"
    choice = layer_choice.choose(measured, "bf16", 20.0, 1.02)[1]
    assert not choice.choice.startswith("fp8")
    assert "fp8-tensorwise, fp8-rowwise not timed: fp8 GEMMs emulated" in choice.reason
    _, emulated_notes = layer_plan.measure(model, x, square_loss, ["bf16"], time.perf_counter() + 60, {"bf16": 40.0})
    assert any("not run in bf16 (a matmul 40x slower than fp32: emulated)" in n for n in emulated_notes)


def test_an_fp8_emulation_far_slower_than_atens_is_not_run_for_the_other_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU backend whose fp8 GEMM is a scalar loop (oneDNN's on AVX512-FP16, before mixprec's CPU GEMM ran ATen's)
    took 50 s a GEMM: six of them were tune's whole budget five times over. The first slow one stops fp8's SQNR."""
    fp8_calls = []

    class SlowFp8(layer_plan._Run):
        def __init__(self, captured: Any, precision: str, loss_scale: float = 1.0) -> None:
            super().__init__(captured, precision, loss_scale)
            if precision.startswith("fp8"):  # inside the timed forward: past 0.1 s and 50x a small layer's fp32 run
                self.holder.layer.register_forward_pre_hook(lambda *_: fp8_calls.append(precision) or time.sleep(0.15))

    monkeypatch.setattr(layer_plan, "_Run", SlowFp8)
    # "slow" is past the 0.1 s floor and 1x the fp32 run here, not 50x: a loaded machine's fp32 run may take 3 ms
    monkeypatch.setattr(layer_plan, "_SLOW_EMULATION", 1.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))  # 3 fp8-able
    measured, notes = layer_plan.measure(model, torch.randn(64, 32), square_loss, ["bf16", *layer_plan.FP8_CANDIDATES],
                                         time.perf_counter() + 60)  # fmt: skip
    assert fp8_calls == ["fp8-tensorwise"]  # the first layer's first fp8 run; its rowwise and the later layers' not
    assert any("fp8's SQNR not measured from layer 0 on: its fp8-tensorwise GEMMs took" in n for n in notes)
    first, later = measured[0], measured[1:3]
    assert "fp8-tensorwise" in first.sqnr_db and first.not_measured["fp8-rowwise"] == layer_plan._SLOW_REASON
    for m in later:
        assert not any(p.startswith("fp8") for p in m.sqnr_db)
        assert m.not_measured["fp8-tensorwise"] == m.not_measured["fp8-rowwise"] == layer_plan._SLOW_REASON
    assert "output head" in measured[3].not_measured["fp8-tensorwise"]  # a rule's reason stays the rule's
    assert all(set(m.ms) == {"fp32", "bf16"} and "bf16" in m.sqnr_db for m in measured)  # the rest as before


def test_fp16_is_measured_behind_the_loss_scale_a_grad_scaler_trains_at() -> None:
    """A loss whose gradients sit below fp16's smallest subnormal (6e-8): raw, fp16 would score them as
    lost; behind the GradScaler fp16 trains with, they are as accurate as anywhere else."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)), torch.randn(64, 32)
    tiny = lambda out: out.square().mean() * 1e-6  # noqa: E731
    measured, notes = layer_plan.measure(model, x, tiny, ["fp16", "bf16"], time.perf_counter() + 60)
    for m in measured:
        assert m.sqnr_db["fp16"] > 40, m  # unscaled: under 1 dB (every gradient flushed to zero)
        assert m.sqnr_db["fp16"] > m.sqnr_db["bf16"]  # 11 mantissa bits against 8, once in range
    assert any("fp16 measured behind a loss scale of 2**16" in n for n in notes)  # the scaler's start, its cap


def test_the_settled_loss_scale_keeps_the_largest_gradient_in_fp16() -> None:
    assert layer_plan.settled_loss_scale(1.0) == 2.0**15  # 65504 / 1 -> 2**15 (2**16 would overflow)
    assert layer_plan.settled_loss_scale(3.0) == 2.0**14
    assert layer_plan.settled_loss_scale(1e-9) == 2.0**16  # not above the scaler's initial scale
    assert layer_plan.settled_loss_scale(1e-9, init_scale=2.0**24) == 2.0**24
    assert layer_plan.settled_loss_scale(1e6) == 2.0**-4
    assert layer_plan.settled_loss_scale(0.0) == 2.0**16 and layer_plan.settled_loss_scale(math.inf) == 2.0**16
    for largest in (1e-3, 0.7, 5.0, 1234.5, 40000.0):
        scale = layer_plan.settled_loss_scale(largest)
        assert math.isfinite(float(torch.tensor(largest * scale).half()))
        assert scale == 2.0**16 or not math.isfinite(float(torch.tensor(largest * scale * 2).half()))


def test_fp8_is_measured_where_the_device_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_plan, "device_has_fp8", lambda device: True)  # the GEMMs run emulated: speed aside
    model, x = _Net(), torch.randn(4, 4, 24)
    measured, notes = layer_plan.measure(model, x, square_loss, ["bf16", *layer_plan.FP8_CANDIDATES],
                                         time.perf_counter() + 60)  # fmt: skip
    by_name = {m.name: m for m in measured}
    assert not any("fp8" in n for n in notes)
    assert 18 < by_name["up"].sqnr_db["fp8-tensorwise"] < by_name["up"].sqnr_db["bf16"]
    assert "fp8-rowwise" in by_name["up"].sqnr_db
    assert "not a multiple of 16" in by_name["odd"].not_measured["fp8-tensorwise"]
    assert "output head" in by_name["head"].not_measured["fp8-tensorwise"]
    assert "fp8 computes the GEMMs of linear kinds" in by_name["conv"].not_measured["fp8-rowwise"]
    odd = layer_choice.choose(measured, "bf16", 20.0, 1.02)[2]
    assert "fp8-tensorwise, fp8-rowwise not measured: out_features 40 not a multiple of 16" in odd.reason


def test_measure_stops_at_the_deadline() -> None:
    measured, notes = layer_plan.measure(_Net(), torch.randn(4, 4, 24), square_loss, ["bf16"], time.perf_counter())
    assert measured == [] and any("the budget ran out after 0 of 4 layers" in n for n in notes)


def _plan_recipe(dtype: str = "bf16") -> Recipe:
    layers = (LayerChoice("up", "linear 16->64", {"fp32": 1.0, "bf16": 0.5}, {"bf16": 40.0}, "fp32", "why"),
              LayerChoice("odd", "linear 64->40", {"fp32": 1.0}, {}, "fp16", "why"),
              LayerChoice("head", "linear 40->16", {"fp32": 1.0}, {}, dtype, "stays"))  # fmt: skip
    return Recipe(dtype=dtype, layers=layers)


def test_a_recipe_with_layers_applies_them_and_round_trips_through_json() -> None:
    recipe = _plan_recipe()
    assert recipe.name == "bf16 O1 layers[1 fp32, 1 fp16]" and not recipe.is_torch_default
    assert [c.name for c in recipe.moved_layers] == ["up", "odd"]
    assert Recipe.from_json(recipe.to_json()) == recipe
    model = _Net()
    run = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert [mixprec.layer_precision(model, n) for n in ("up", "odd", "head", "conv")] == ["fp32", "fp16", None, None]
    assert run.scaler is not None  # a layer in fp16 needs its gradients scaled
    with run.autocast():
        loss = square_loss(run.model(torch.randn(2, 4, 8)))
    run.backward(loss)
    run.step()
    table = recipe.table()
    assert "per-layer plan:" in table and "up     fp32" in table and "    linear 16->64: why" in table


def test_an_fp32_recipe_with_a_bf16_layer_trains() -> None:
    recipe = Recipe(dtype="fp32", layers=(LayerChoice("up", "linear", {"fp32": 1.0, "bf16": 0.1}, {"bf16": 40.0},
                                                      "bf16", "fastest"),))  # fmt: skip
    model = _Net()
    run = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert run.scaler is None and mixprec.layer_precision(model, "up") == "bf16"
    loss = square_loss(run.model(torch.randn(2, 4, 8)))
    assert loss.dtype is torch.float32
    run.backward(loss)


def test_a_layer_planned_in_delayed_fp8_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8-delayed keeps an amax history"):
        Recipe(layers=(LayerChoice("up", "linear", {}, {}, "fp8-delayed", ""),))


def test_tune_records_a_per_layer_table() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    recipe = mixprec.tune(model, torch.randn(64, 32), square_loss, dtypes=("bf16", "fp32"), budget_s=30)
    assert [c.name for c in recipe.layers] == ["0", "2", "4"]
    for c in recipe.layers:
        emulated = "bf16 not measured: emulated here" in c.reason
        assert c.ms_of("fp32") is not None and (c.ms_of("bf16") is not None or emulated)
        assert c.choice in ("bf16", "fp32")
    assert any("no layer in fp8" in n for n in recipe.notes)
    assert Recipe.from_json(recipe.to_json()).layers == recipe.layers
    moved = recipe.moved_layers
    # Either the plan was raced and chosen (its layers are applied), or every layer stays as the recipe has it.
    chosen = next(m for m in recipe.measurements if m.status == "chosen")
    assert (chosen.name == recipe.name) and (not moved or "layers[" in recipe.name)
    assert all(math.isfinite(c.ms_of("fp32") or math.nan) for c in recipe.layers)


@requires_cuda
def test_on_a_gpu_with_fp8_the_projections_are_timed_in_fp8() -> None:
    from mixprec.bench.workloads import WORKLOADS

    device = torch.device("cuda")
    if not layer_plan.device_has_fp8(device):
        pytest.skip("needs a GPU of compute capability 8.9+")
    task = WORKLOADS["transformer"].build("default", device)
    model, (tokens, targets) = task.model.to(device), task.batch(0)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return task.loss_fn(out.float(), targets)

    measured, notes = layer_plan.measure(model, tokens, loss_of, ["bf16", *layer_plan.FP8_CANDIDATES],
                                         time.perf_counter() + 120)  # fmt: skip
    linear1 = next(m for m in measured if m.name.endswith("linear1"))
    assert {"fp32", "bf16", "fp8-tensorwise", "fp8-rowwise"} <= set(linear1.ms), (linear1, notes)
    assert linear1.sqnr_db["fp8-tensorwise"] > 20
    print(reporting.layer_table(layer_choice.choose(measured, "bf16", 20.0, 1.02)))  # the figures, with -s


def test_a_layer_the_recipe_keeps_in_fp32_is_fp32_by_default() -> None:
    plan = (LayerChoice("up", "linear 16->64", {}, {}, "fp32", ""), LayerChoice("head", "linear 40->16", {}, {},
                                                                                "fp32", ""))  # fmt: skip
    ops = Recipe(dtype="bf16", fp32_ops=("linear",), layers=plan)
    assert [c.default for c in ops.layers] == ["fp32", "fp32"] and not ops.moved_layers
    assert ops.name == "bf16 O1 +fp32[linear]"
    kept = Recipe(dtype="bf16", keep_fp32=("he*",), layers=plan)
    assert [c.default for c in kept.layers] == ["bf16", "fp32"] and [c.name for c in kept.moved_layers] == ["up"]
    assert Recipe.from_json(kept.to_json()) == kept
    measured = [_measured("up", {"fp32": 1.0, "bf16": 0.5}, {"bf16": 40.0})]
    (choice,) = layer_choice.choose(measured, lambda m: ops.layer_default(m.name, "linear"), 20.0, 1.02)
    assert choice.choice == "bf16" and choice.default == "fp32" and choice.moved


def test_a_floor_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="layer_sqnr_db must be a finite number"):
        mixprec.tune(nn.Linear(4, 4), torch.randn(2, 4), square_loss, layer_sqnr_db=math.nan)
