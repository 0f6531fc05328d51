"""tune(memory_budget=...): the chosen recipe fits (as memory_plan predicts), says what it gave up, and a budget
nothing fits is refused with the smallest figure any recipe reaches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import mixprec
from mixprec._src.tune.memory_fit import parse_bytes


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)), \
        torch.randn(16, 64)  # fmt: skip


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def test_sizes_parse() -> None:
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("500 MB") == 500 * 10**6 and parse_bytes(4096) == 4096
    for bad in ("-1GB", "lots", "12 parsecs", 0):
        with pytest.raises(ValueError, match="memory_budget"):
            parse_bytes(bad)


def test_a_budget_picks_a_recipe_that_fits_and_says_what_it_gave_up() -> None:
    from mixprec._src.tune.memory_fit import VARIANTS

    model, batch = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())

    def peak(**options: object) -> int:
        plan = mixprec.memory_plan(model, optimizer, mixprec.PrepareConfig(**options), batch=batch, loss_fn=_loss)
        assert plan.peak is not None
        return plan.peak

    plain, o1 = peak(level="bf16-sr"), peak(level="O1")
    smallest = min(peak(level="bf16-sr", **variant) for variant in VARIANTS)
    assert smallest < plain < o1
    budget = (smallest + plain) // 2  # bf16-sr fits only by giving something up; torch.amp's default does not
    recipe = mixprec.tune(model, batch, _loss, budget_s=20, dtypes=("bf16",), levels=("bf16-sr",), per_layer=False,
                          memory_budget=budget)  # fmt: skip
    plan = mixprec.memory_plan(model, optimizer, recipe, batch=batch, loss_fn=_loss)
    assert plan.peak is not None and plan.peak <= budget
    assert recipe.level == "bf16-sr" and (recipe.step_in_backward or recipe.optimizer_state != "fp32")
    assert any("to fit it gave up" in note for note in recipe.notes), recipe.notes
    assert any("torch.amp's default is over the memory budget" in note for note in recipe.notes)
    fresh, _ = _mlp()
    applied = recipe.apply(fresh, torch.optim.AdamW(fresh.parameters()))  # the recipe prepares as it says
    _loss(applied.model(batch)).backward()
    applied.optimizer.step()
    report = mixprec.memory_report(fresh, applied.optimizer)
    assert report.total == plan.state


def test_a_budget_nothing_fits_is_refused_with_the_smallest_figure() -> None:
    model, batch = _mlp()
    with pytest.raises(ValueError, match=r"no recipe fits in a memory budget of 9\.8 KiB: the smallest, bf16 bf16-sr "
                                         r"state\[\w+\].*, needs [0-9.]+ KiB at this batch"):  # fmt: skip
        mixprec.tune(model, batch, _loss, budget_s=5, memory_budget="10KB", per_layer=False)


def test_o2_gives_up_its_fp32_moments_for_bf16_ones_before_quantizing_them() -> None:
    """Between the step in backward and fp8 state: bf16 moments (O2 at 14 bytes a parameter instead of 18). Seven
    1 MB gradients: the step in backward's bucket (1 MiB beside the largest) holds a part of them."""
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.GELU(), nn.Linear(512, 512))]
    model, batch = nn.Sequential(nn.Linear(64, 512), *layers, nn.GELU(), nn.Linear(512, 8)), torch.randn(16, 64)
    optimizer = torch.optim.AdamW(model.parameters())

    def peak(**options: object) -> int:
        plan = mixprec.memory_plan(model, optimizer, mixprec.PrepareConfig("O2", **options), batch=batch,
                                   loss_fn=_loss)  # fmt: skip
        assert plan.peak is not None
        return plan.peak

    from mixprec._src.tune.memory_fit import Fit

    bf16, in_backward = peak(optimizer_state="bf16"), peak(step_in_backward=True)
    assert peak(optimizer_state="fp8") < bf16 < in_backward < peak()
    fit = Fit(model, optimizer, batch, _loss, (bf16 + in_backward) // 2)
    base = mixprec.Recipe(level="O2")
    assert fit.changes(base) == {"optimizer_state": "bf16"}
    fitted = dataclasses.replace(base, optimizer_state="bf16")
    assert "the optimizer state's precision (bf16 instead of fp32)" in fit.gave_up(fitted)


def test_memory_planning_is_not_spent_from_the_time_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    import time
    import types

    from mixprec._src.tune import memory_fit
    from mixprec._src.tune.rounds import Search

    search = Search(nn.Linear(2, 2), None, None, _loss, torch.device("cpu"), None, 100.0, None)  # type: ignore[arg-type]
    assert search.deadline == 100.0
    search.fit = types.SimpleNamespace(seconds=7.5)
    assert search.deadline == 107.5  # planning's seconds do not end the measuring
    # and tune says how long planning took
    plan, calls = memory_fit.memory_plan, []

    def slow_plan(*args: object, **kwargs: object) -> object:
        calls.append(1)
        time.sleep(0.05)
        return plan(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(memory_fit, "memory_plan", slow_plan)
    model, batch = _mlp()
    recipe = mixprec.tune(model, batch, _loss, budget_s=20, dtypes=("bf16",), levels=("bf16-sr",), per_layer=False,
                          memory_budget="1GiB")  # fmt: skip
    (note,) = [n for n in recipe.notes if n.startswith("memory planning took")]
    seconds = float(re.findall(r"took ([0-9.]+) s", note)[0])
    assert calls and seconds >= 0.05 * len(calls) - 0.05  # rounded to tenths
