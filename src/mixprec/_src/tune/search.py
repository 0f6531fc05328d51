"""tune: find the fastest precision recipe that keeps a model's accuracy, measured on this machine.

``recipe = mixprec.tune(model, inputs, loss_fn, targets=targets)`` measures, on the real model
and batch, full training steps (forward, backward, optimizer step) of candidate recipes and
returns the fastest one whose numerics stay within ``tolerance`` of fp32. A :class:`Recipe` is
data: a compute dtype, op moves into fp32, modules kept in fp32, a memory layout, a
:func:`mixprec.prepare` level, and the measurements that chose it. The search::

    diagnose(model, dtype) for each low dtype       -> modules kept in fp32 (a constraint on every candidate)
    round 1: torch.amp's default, each dtype, fp32  -> the dtype
    profile the chosen dtype and fp32 (torch.profiler): ops whose forward+backward is slower in
             low precision than in fp32
    round 2: those ops moved to fp32 (each, all), channels_last if the model has 4-D/5-D weights
    round 3: prepare levels (O2, and bf16-sr for bf16; bf16-pure if asked) with the best layout
    choose:  the fastest candidate that passed the accuracy guard; torch.amp's default unless
             another beats it by ``min_speedup``

Per-layer plan (``per_layer=True``, first, in at most a quarter of the budget): each GEMM layer
(``gemms.sites``) is timed at its own shapes (forward and both backward GEMMs) in each searched dtype and,
on devices with fp8 GEMMs, fp8 (tensorwise, rowwise), and its SQNR against fp32 measured
(``layers/plan.py``). Before the final round, the best recipe of each dtype gets a plan: each layer
takes the fastest precision above ``layer_sqnr_db`` (as the recipe has it unless another is
``min_speedup`` faster; never fp8 slower than bf16); where any layer moves, the planned recipe races
torch.amp's default through the accuracy guard (round 4) and, if it passes, the final round. The
table is the chosen recipe's ``Recipe.layers`` (applied only if the planned recipe won).

In every round the candidates train in lockstep, one step each in alternating order (as
``mixprec bench`` does), so that a shared machine's load falls on all alike; a candidate's speed
is the median of its warm steps against torch.amp's default in the same round, with its noise (how
uncertain that median is, from the step-to-step ratios: :mod:`timing`); a noisy round is repeated, up
to ``MAX_STEPS`` steps, and a candidate must beat the default by its noise as well as by
``min_speedup`` (a note says when the noise decided). Every candidate
starts from a deep copy of the same weights and optimizer state; its first steps are compared with
fp32's (see :class:`Tolerance`). The search stops at ``budget_s`` and keeps the best so far.
``torch.compile`` is not searched: compiling a model takes longer than a tuning budget of a minute.

Everything here syncs with the device: it times steps.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src import input_checks, timing
from mixprec._src.dtypes import parse_dtype, short_name
from mixprec._src.layers import plan as layer_plan
from mixprec._src.observe.diagnostics import diagnose
from mixprec._src.policy.rules import default_policy
from mixprec._src.prepare.config import Level
from mixprec._src.prepare.levels import prepared_state
from mixprec._src.tune import memory_fit, probes, rounds
from mixprec._src.tune.layer_plans import LayerPlans
from mixprec._src.tune.recipe import Recipe, Tolerance
from mixprec._src.tune.rounds import Progress, Search

__all__ = ["tune"]

_DIAGNOSE_STEPS = 4  # diagnose costs about this many training steps (fp32 and low-precision passes with hooks)
_PLAN_SHARE = 0.25  # the share of the budget the per-layer measurements may take


def tune(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    targets: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    budget_s: float = 60.0,
    tolerance: Tolerance | None = None,
    dtypes: Sequence[torch.dtype | str] = ("bf16", "fp16", "fp32"),
    levels: Sequence[Level | str] = ("O1", "O2", "bf16-sr"),
    min_speedup: float = 1.02,
    per_layer: bool = True,
    layer_sqnr_db: float = 20.0,
    progress: Progress | None = None,
    memory_budget: int | float | str | None = None,
) -> Recipe:
    """Find the fastest recipe for ``model`` on this machine that keeps its accuracy; see the module docstring.

    The loss is ``loss_fn(model(batch), targets)`` with ``targets``, else ``loss_fn(model(batch))``
    (default: the mean square of the floating outputs), as in :func:`mixprec.diagnose`. ``model``
    and ``optimizer`` are not changed: every candidate trains a deep copy.

    Args:
        model: the fp32 model, on its device.
        batch: a tensor, a tuple/list of positional inputs or a dict of keyword inputs, on the model's device.
        loss_fn: see above.
        targets: the second argument of ``loss_fn``.
        optimizer: the optimizer you train with (its state is copied, not stepped); default
            ``torch.optim.AdamW(model.parameters())``.
        device: where the model is; default and only valid value: the device of its parameters.
        budget_s: seconds the search may measure for; it stops there and keeps the best so far. Planning
            memory for ``memory_budget`` is not counted (a note says how long it took).
        tolerance: the accuracy guard; default :class:`Tolerance`'s.
        dtypes: compute dtypes to search (fp32 counts: if it is the fastest, the recipe is fp32).
        levels: :func:`mixprec.prepare` levels to search besides O1 (always searched). bf16-pure is left
            out by default: its round-to-nearest updates lose those smaller than 2**-8 of a weight, which
            a few steps cannot show; pass it to search it.
        min_speedup: how much faster than torch.amp's default another recipe must be to be chosen
            (the measurements' noise on a shared machine is a few percent); also how much faster than
            the recipe's dtype another precision must be for one layer.
        per_layer: plan each GEMM layer's precision (see "Per-layer plan" above); the
            measurements take at most a quarter of the budget.
        layer_sqnr_db: a layer's SQNR floor against fp32 (the worst of its output and both gradients).
        progress: called with a line of text as the search goes.
        memory_budget: the most bytes a rank may hold at its peak (``"24GiB"``, ``"500MB"`` or a number), as
            :func:`mixprec.memory_plan` predicts it for ``batch``: a recipe over it is never chosen, and a level
            over it is searched with what it must give up to fit (the step in backward, then quantized
            optimizer state); the recipe's notes say what it gave up. Nothing fits: ``ValueError`` with the
            smallest peak any recipe reaches. The candidates themselves are measured as usual (the fp32
            reference and torch.amp's default too, over the budget or not: they are the yardsticks).

    Returns:
        The chosen :class:`Recipe`, with every measurement and notes.

    Raises:
        ValueError: ``budget_s <= 0``, a model prepared by :func:`mixprec.prepare`, a batch on another
            device, a loss that is not a scalar, an optimizer over other tensors, a bad dtype, a memory budget
            no recipe fits in.
        TypeError: ``loss_fn`` is not callable.
    """
    start = time.perf_counter()
    if not (isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    if prepared_state(model) is not None:
        raise ValueError(
            "tune needs the fp32 model: this one was prepared by mixprec.prepare; "
            "call mixprec.export_fp32(model) first, or tune before preparing"
        )
    found = input_checks.check_inputs(model, (batch, targets), loss_fn)
    if device is not None and torch.device(device).type != found.type:
        raise ValueError(f"device={device!r} but the model is on {found}; move the model and batch there first")
    if min_speedup < 1:
        raise ValueError(f"min_speedup must be >= 1, got {min_speedup}")
    if not (isinstance(layer_sqnr_db, (int, float)) and math.isfinite(layer_sqnr_db)):
        raise ValueError(f"layer_sqnr_db must be a finite number of dB, got {layer_sqnr_db!r}")
    tol = tolerance if tolerance is not None else Tolerance()
    searched = [parse_dtype(d, what="tune dtype") for d in dtypes]
    search_levels = [Level.from_name(lv).value for lv in levels if Level.from_name(lv) is not Level.O1]
    if not searched:
        raise ValueError("dtypes names no dtype to search; e.g. dtypes=('bf16', 'fp32')")
    if targets is not None and loss_fn is None:
        raise ValueError("targets= needs loss_fn(output, targets) to compute the loss with them")
    loss_of = _loss_of(loss_fn, targets)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
    _check_optimizer(model, optimizer)
    with torch.no_grad():  # the loss must be a scalar: fail here, not inside a candidate (on a copy: BatchNorm)
        copied = copy.deepcopy(model)
        timing.sync(found)
        begin = time.perf_counter()
        loss_of(input_checks.call_model(copied, batch))
        timing.sync(found)
        forward_s = time.perf_counter() - begin
        del copied
    device_type = found.type
    default_dtype = torch.get_autocast_dtype(device_type)
    search = Search(model, optimizer, batch, loss_of, found, tol, start + budget_s, progress)
    search.first_step_s = probes.first_step_s(forward_s, list(dict.fromkeys([*searched, default_dtype])), found)
    notes: list[str] = ["torch.compile is not searched: compiling takes longer than a tuning budget"]
    if memory_budget is not None:
        search.fit = memory_fit.Fit(model, optimizer, batch, loss_of, memory_fit.parse_bytes(memory_budget))
        bases = [
            Recipe(dtype=d, level=Level.from_name(lv))
            for d in searched
            if d is not torch.float32
            for lv in ("O1", *search_levels)
            if d is torch.bfloat16 or lv in ("O1", "O2")
        ]
        if torch.float32 in searched:
            bases.append(Recipe(dtype=torch.float32))
        notes += search.fit.check(bases)
    # The caller's random state is left as it was (bf16-sr draws its rounding seed from it).
    with torch.random.fork_rng(devices=[found] if found.type == "cuda" else []):
        plan = None
        if per_layer:
            search.say("per-layer plan: each GEMM layer at its shapes")
            wanted = [short_name(d) for d in searched] + list(layer_plan.FP8_CANDIDATES)
            # dtypes whose matmuls are emulated here, with how much slower than fp32's they are
            emulated = {short_name(d): s / (3 * forward_s) for d, s in search.first_step_s.items() if forward_s > 0}
            measured, plan_notes = layer_plan.measure(
                model, batch, loss_of, wanted, start + search.planning_s + _PLAN_SHARE * budget_s, emulated, search.say
            )
            notes += plan_notes
            plan = LayerPlans(measured, layer_sqnr_db, min_speedup) if measured else None
        recipe = _run_search(
            search, model, batch, loss_fn, targets, searched, search_levels, default_dtype, min_speedup, notes, plan
        )
        if plan is not None:
            recipe = plan.attach(recipe)
    if search.planning_s:
        note = f"memory planning took {search.planning_s:.1f} s, outside budget_s (which is for measuring)"
        recipe = dataclasses.replace(recipe, notes=(*recipe.notes, note))
    measured_on = f"{found.type}" + (f" ({torch.cuda.get_device_name(found)})" if found.type == "cuda" else "")
    return dataclasses.replace(
        recipe, measured_on=f"{measured_on}, torch {torch.__version__}", tuning_s=time.perf_counter() - start
    )


def _loss_of(loss_fn: Callable[..., torch.Tensor] | None, targets: Any) -> Callable[[Any], torch.Tensor]:
    if targets is None:
        return functools.partial(input_checks.scalar_loss, loss_fn=loss_fn)
    assert loss_fn is not None
    return functools.partial(
        input_checks.scalar_loss, loss_fn=functools.partial(input_checks.with_targets, loss_fn, targets)
    )


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if prepared_state(optimizer) is not None:
        raise ValueError("this optimizer was prepared by mixprec.prepare; tune the fp32 model and its fp32 optimizer")
    if not input_checks.holds_only_parameters_of(optimizer, model):
        raise ValueError(
            "the optimizer holds a tensor that is not a parameter of this model; create it from model.parameters()"
        )


def _run_search(
    search: Search,
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    targets: Any,
    dtypes: list[torch.dtype],
    levels: list[str],
    default_dtype: torch.dtype,
    min_speedup: float,
    notes: list[str],
    plan: LayerPlans | None = None,
) -> Recipe:
    torch_default = Recipe(dtype=default_dtype)
    lows = [d for d in dtypes if d is not torch.float32]
    keep: dict[torch.dtype, tuple[str, ...]] = {}
    scale: dict[torch.dtype, float] = {}

    def base(dtype: torch.dtype, **changes: Any) -> Recipe:
        if dtype is torch.float32:
            return Recipe(dtype=torch.float32)
        return Recipe(dtype=dtype, keep_fp32=keep.get(dtype, ()), loss_scale=scale.get(dtype, 2.0**16), **changes)

    # Round 1: the dtype, with torch's lists.
    default = search.trial(torch_default)
    search.ref = search.trial(Recipe(dtype=torch.float32))
    round1 = [default, *[search.trial(Recipe(dtype=d)) for d in lows if d is not default_dtype], search.ref]
    search.race(default, round1, "round 1 (dtype)")
    # A dtype that fails the accuracy guard gets diagnose's findings as a constraint: the modules
    # whose values leave its range stay in fp32 (bf16 has fp32's range and rarely needs any).
    for dtype in lows:
        result = search.results.get(Recipe(dtype=dtype).name)
        if (
            result is None
            or result.status != "rejected"
            or result.reason.startswith("slower")
            or not search.fits(_DIAGNOSE_STEPS * (default.expected_s(default) + search.ref.expected_s(default)))
        ):
            continue
        search.say(f"diagnose in {short_name(dtype)}: which modules leave its range")
        report = diagnose(copy.deepcopy(model), batch, loss_fn, targets=targets, dtype=dtype)
        if report.keep_fp32:
            keep[dtype], scale[dtype] = tuple(report.keep_fp32), report.suggested_loss_scale
            notes.append(
                f"diagnose({short_name(dtype)}) keeps {', '.join(report.keep_fp32)} in fp32 "
                f"in every {short_name(dtype)} candidate"
            )
    if keep and search.time_left():
        retry = [search.trial(base(d)) for d in keep]
        search.race(default, retry, "round 1b (modules diagnose keeps in fp32)")
        round1 += retry
    allowed = [base(d).name for d in dtypes]
    best = search.best([t.name for t in round1 if t.name in allowed])
    # Rounds 2 and 3 improve the best low-precision dtype, which may then beat fp32.
    # (the dtype to go on with: a level of it may fit the memory budget where its O1 recipe does not)
    best_low = search.best(
        [t.name for t in round1 if t.name in allowed and t.recipe.dtype is not torch.float32], within_memory=False
    )
    best_trial = next((t for t in round1 if t.name == best_low), None)
    # The profile takes a step of each: only if both fit in the budget.
    if best_trial is not None and search.fits(best_trial.expected_s(default) + search.ref.expected_s(default)):
        assert best_low is not None
        dtype = best_trial.recipe.dtype
        # Round 2: op moves the profile suggests, and the layout.
        lower = default_policy(search.device.type).lower
        low_cost, fp32_cost = probes.profile(best_trial, lower), probes.profile(search.ref, lower)
        slower = sorted(
            (op for op in low_cost if low_cost[op] > fp32_cost.get(op, math.inf)),
            key=lambda op: fp32_cost[op] - low_cost[op],
        )
        if slower:
            notes.append(
                "profile: slower in "
                + short_name(dtype)
                + " than fp32 (fwd+bwd): "
                + ", ".join(f"{op} {low_cost[op] * 1e3:.1f} vs {fp32_cost[op] * 1e3:.1f} ms" for op in slower)
            )
        candidates = [base(dtype, fp32_ops=(op,)) for op in slower[:3]]
        if len(slower) > 1:
            candidates.append(base(dtype, fp32_ops=tuple(slower)))
        conv = probes.has_conv_weights(model)
        if conv:
            candidates.append(base(dtype, layout="channels_last"))
        del round1
        if candidates:
            search.round(default, candidates, "round 2 (ops, layout)")
        best_low = search.best([best_low, *[r.name for r in candidates]], within_memory=False)
        assert best_low is not None
        chosen = search.recipes[best_low]
        if conv and chosen.fp32_ops and chosen.layout == "contiguous" and search.time_left():
            both = dataclasses.replace(chosen, layout="channels_last")
            search.round(default, [both], "round 2b (ops with channels_last)")
            best_low = search.best([best_low, both.name], within_memory=False)
        # Round 3: prepare levels, with the best layout (op moves apply at O1 only).
        assert best_low is not None
        layout = search.recipes[best_low].layout
        levels = [lv for lv in levels if dtype is torch.bfloat16 or lv == "O2"]  # the other levels keep bf16 weights
        candidates = [base(dtype, level=lv, layout=layout) for lv in levels]
        if search.fit is not None:  # each level as it fits the memory budget (O1 too, where it does not as is)
            o1 = [base(dtype, layout=layout)] if not search.fit.fits(base(dtype, layout=layout)) else []
            fitted = [(c, search.fit.changes(c)) for c in [*o1, *candidates]]
            candidates = [dataclasses.replace(c, **v) for c, v in fitted if v is not None]
        if candidates and search.time_left():
            names = search.round(default, candidates, "round 3 (levels)")
            best_low = search.best([best_low, *names]) or best_low
        best = search.best([n for n in (best, best_low) if n is not None])
    # Round 4: the best recipe of each dtype with its per-layer plan, through the accuracy guard (then in the
    # final round): a plan depends on the recipe's dtype, and either may win.
    if plan is not None:
        bests = [search.best([n for n, r in search.recipes.items() if r.dtype is d]) for d in dtypes]
        planned = {n: p for n in bests if n is not None and (p := plan.planned(search.recipes[n])) is not None}
        if planned and search.time_left():
            search.round(search.trial(torch_default), list(planned.values()), "round 4 (per-layer plans)")
            for name, p in planned.items():
                result = search.results[p.name]
                plan.outcome[name] = f"{p.name}: {result.status}" + (f" ({result.reason})" if result.reason else "")
            best = search.best([n for n in (best, *(p.name for p in planned.values())) if n is not None])
    finalists = search.final_round(torch_default, dtypes, min_speedup, notes)
    if finalists is not None:
        best = search.best([*finalists, *([torch_default.name] if torch_default.dtype in dtypes else [])])
    return rounds.choose(search, best, torch_default, dtypes, min_speedup, notes, finalists)
