"""tune's rounds: candidates racing torch.amp's default in lockstep, each judged against fp32.

A :class:`Search` holds every measurement so far and the budget. :meth:`Search.race` steps the
default and the candidates in alternating order (a shared machine's load falls on all alike),
repeats a noisy round (:mod:`timing`), stops a candidate that cannot win, and records each
one's speed, noise and accuracy; :meth:`Search.final_round` races the finalists head to head.
Everything here syncs with the device: it times steps.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src import timing
from mixprec._src.dtypes import short_name
from mixprec._src.tune.probes import COLD_SLOW
from mixprec._src.tune.recipe import Measurement, Recipe, Tolerance
from mixprec._src.tune.tables import line
from mixprec._src.tune.trial import ACCURACY_STEPS, Trial, judge

__all__ = ["FINALISTS", "MAX_STEPS", "SLOW", "STEPS", "Progress", "Search", "changes", "choose"]

Progress = Callable[[str], None]
STEPS = 4  # steps per candidate per round: 3 timed, their median is the candidate's time
MAX_STEPS = 8  # ... repeated up to this many while the speed ratios are noisy (see timing.NOISY)
SLOW = 1.5  # a candidate this much slower than the default after its checked steps cannot win: stopped
FINALISTS = 3  # the fastest candidates raced again, head to head, before choosing


class Search:
    fit: Any = None  # memory_fit.Fit where tune has a memory budget: a recipe over it is never the best

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        inputs: Any,
        loss_of: Callable[[Any], torch.Tensor],
        device: torch.device,
        tol: Tolerance,
        deadline: float,
        progress: Progress | None,
    ) -> None:
        self.model, self.optimizer, self.inputs, self.loss_of = model, optimizer, inputs, loss_of
        self.device, self.tol, self.progress = device, tol, progress
        self._deadline = deadline
        self.results: dict[str, Measurement] = {}
        self.recipes: dict[str, Recipe] = {}
        self.out_of_time = False
        self.ref: Trial | None = None  # fp32, for accuracy
        self.cold_s: float | None = None  # the default's first step in the first round
        self.setup_s = 0.0  # the longest a candidate took to set up (a deep copy, prepare)
        self.first_step_s: dict[torch.dtype, float] = {}  # a first step's estimate, by dtype (see first_step_s)
        self.repeated = 0  # the most steps a noisy round took (0: none was repeated)

    @property
    def planning_s(self) -> float:
        """Seconds spent planning memory for the budget (``fit``): not the measuring budget's."""
        return self.fit.seconds if self.fit is not None else 0.0

    @property
    def deadline(self) -> float:
        """When the budget ends: ``budget_s`` of measuring, the memory planning's seconds not counted."""
        return self._deadline + self.planning_s

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def fits(self, seconds: float) -> bool:
        """Whether work of ``seconds`` ends inside the budget (if not, the search did not finish)."""
        if time.perf_counter() + seconds > self.deadline:
            self.out_of_time = True  # the search did not finish; a cheaper round later may still fit
            return False
        return True

    def time_left(self) -> bool:
        return self.fits(0.0)

    def trial(self, recipe: Recipe) -> Trial:
        begin = time.perf_counter()
        trial = Trial(recipe, self.model, self.optimizer, self.inputs, self.loss_of, self.device)
        self.setup_s = max(self.setup_s, time.perf_counter() - begin)
        trial.first_estimate_s = self.first_step_s.get(recipe.dtype, 0.0)
        return trial

    def round(self, default: Trial, recipes: list[Recipe], label: str) -> list[str]:
        """Race ``recipes`` against ``default`` if their checked steps fit in the budget; returns their names.

        Copying a large model for every candidate takes seconds: a round that cannot finish is not started.
        """
        step_s = default.median_s() or default.expected_s(default)
        if not self.fits(self.setup_s * len(recipes) + step_s * (len(recipes) + 1) * ACCURACY_STEPS):
            for r in recipes:
                self.recipes[r.name] = r
                self.results[r.name] = Measurement(r.name, "not measured", reason="the budget ran out")
            self.say(f"{label}: skipped, the budget would run out: {', '.join(r.name for r in recipes)}")
            return [r.name for r in recipes]
        self.race(default, [self.trial(r) for r in recipes], label)
        return [r.name for r in recipes]

    def race(self, default: Trial, trials: list[Trial], label: str) -> None:
        """Step ``default`` and ``trials`` in lockstep; record each trial's speed and accuracy."""
        everyone = [default, *[t for t in trials if t is not default]]
        for t in everyone:
            t.times = []
        self.say(f"{label}: {', '.join(t.name for t in trials)}")
        self._lockstep(default, everyone, stop_slow=True)
        base = default.median_s()
        for t in trials:
            self.record(t, default, base)
        for t in trials:
            self.say(f"  {self.results[t.name].name}: {line(self.results[t.name])}")

    def _lockstep(self, default: Trial, everyone: list[Trial], *, stop_slow: bool) -> None:
        """``STEPS`` steps of each, in alternating order, none past the deadline; up to ``MAX_STEPS``
        while a running candidate's speed against ``default`` (or the default's own time) is noisy.

        Raises:
            Exception: what a step of ``default`` or of the fp32 reference raised (a candidate's is its
                rejection, recorded in ``stopped`` and ``failed``).
        """
        step = 0
        while step < STEPS or self._noisy(default, everyone, step):
            for t in everyone if step % 2 == 0 else reversed(everyone):
                # An emulated dtype's first step is started only if it leaves half the time left to the others.
                left = self.deadline - time.perf_counter()
                if not t.times and t.first_estimate_s and t.first_estimate_s > left / 2:
                    t.stopped = t.stopped or (
                        f"a step would take about {t.first_estimate_s:.0f} s, past the budget "
                        f"({short_name(t.recipe.dtype)} matmuls are emulated on this device)"
                    )
                # Skip a step that would end past the deadline: the budget is the user's.
                if t.stopped or not self.time_left() or time.perf_counter() + t.expected_s(default) > self.deadline:
                    if not t.stopped:
                        self.out_of_time = True
                    continue
                try:
                    t.step()
                except Exception as exc:  # a candidate that cannot train here: rejected with its reason, never fatal
                    if t is default or t is self.ref:
                        raise
                    t.stopped = t.failed = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            if stop_slow:
                self._stop_slow(default, everyone)
            step += 1

    def _noisy(self, default: Trial, everyone: list[Trial], steps: int) -> bool:
        """Whether another lockstep step is worth its time: a running candidate's speed is noisy."""
        if steps >= MAX_STEPS or not self.time_left():
            return False
        running = [t for t in everyone if not t.stopped and len(t.times) == steps]
        step_s = sum(t.expected_s(default) for t in running)
        if not running or time.perf_counter() + step_s > self.deadline:  # optional: not "out of time"
            return False
        if any((t.noise(default) or 0.0) > timing.NOISY for t in running):
            self.repeated = max(self.repeated, steps + 1)
            return True
        return False

    def _stop_slow(self, default: Trial, trials: list[Trial]) -> None:
        base = default.median_s()
        # Under a memory budget the default may not fit: a candidate that does is not judged slow against it.
        over = self.fit is not None and not self.fit.fits(default.recipe)
        for t in trials:
            if t is default or t.stopped or (t is self.ref and not t.checked):  # fp32 must finish its checked steps
                continue
            if over and self.fit.fits(t.recipe):
                continue
            mine = t.median_s()
            if self.cold_s is None and default.times and default.times[0] > 0:
                self.cold_s = default.times[0]  # first steps pay one-time costs: compare them with a first step
            # (and over a second: one-time costs of a few ms, module hooks or a first fp16 kernel, are not slowness)
            if len(t.times) == 1 and self.cold_s is not None and t.times[0] > max(COLD_SLOW * self.cold_s, 1.0):
                t.stopped = f"{self.cold_s / t.times[0]:.2f}x torch.amp's default on the first step"
            elif t.checked and base is not None and mine is not None and mine > SLOW * base:
                # the default runs on: its median then is not the one the table's column divides by
                t.stopped = f"{base / mine:.2f}x torch.amp's default's first {len(default.times)} steps"

    def record(self, t: Trial, default: Trial, base: float | None) -> None:
        mine = t.median_s()
        vs = base / mine if base is not None and mine is not None else None
        ms = None if mine is None else mine * 1e3
        noise = t.noise(default)
        self.recipes[t.name] = t.recipe
        if t.failed:
            self.results[t.name] = Measurement(t.name, "rejected", reason=t.failed)
            return
        if t.stopped and not t.checked:
            why = f"slower: {t.stopped} (stopped early)"
            first_ms = t.times[0] * 1e3 if t.times else None
            self.results[t.name] = Measurement(t.name, "rejected", first_ms, None, reason=why)
            return
        if not t.checked or mine is None:
            self.results[t.name] = Measurement(t.name, "not measured", ms, vs, reason="the budget ran out", noise=noise)
            return
        assert self.ref is not None
        if t is self.ref:
            why = self._budget(t, "the fp32 reference")
            self.results[t.name] = Measurement(t.name, "passed", ms, vs, 0.0, 1.0, 1.0, why, noise)
            return
        if not self.ref.checked:  # a slow or loaded machine: fp32 did not finish its accuracy steps in the round
            why = "the fp32 reference did not finish its accuracy steps"
            self.results[t.name] = Measurement(t.name, "not measured", ms, vs, noise=noise, reason=why)
            return
        err, gcos, ucos, why = judge(t, self.ref, self.tol)
        status = "rejected" if why else "passed"
        if not why and t.stopped:  # checked and timed: it passed, and was stopped only to save the budget
            why = f"stopped early to save the budget: it ran at {t.stopped}"
        self.results[t.name] = Measurement(t.name, status, ms, vs, err, gcos, ucos, self._budget(t, why), noise)

    def _budget(self, t: Trial, why: str) -> str:
        """``why``, and where ``t`` is over the memory budget, that (with its bytes): it is never chosen."""
        if self.fit is None or self.fit.fits(t.recipe):
            return why
        over = f"over the memory budget: {self.fit.describe(t.recipe)}, never chosen"
        return f"{why}; {over}" if why else over

    def final_round(
        self, default_recipe: Recipe, dtypes: list[torch.dtype], min_speedup: float, notes: list[str]
    ) -> list[str] | None:
        """Race the finalists and torch.amp's default again, together, for figures that compare.

        Rounds run minutes apart on a shared machine: a step's time moves between them. The finalists
        are the fastest passed candidates and the simplest within ``min_speedup`` of the fastest. Their
        ``ms/step`` and ``x default`` become this round's; the others keep their own round's ratio
        and lose their ``ms/step`` (not comparable). Returns the finalists' names, or ``None`` when
        there are none or the round does not fit in the budget.
        """
        passed = sorted(
            (
                n
                for n, m in self.results.items()
                if m.status == "passed"
                and m.vs_default is not None
                and n != default_recipe.name
                and self.recipes[n].dtype in dtypes
            ),
            key=lambda n: -(self.results[n].vs_default or 0.0),
        )
        if not passed:
            return None
        fastest = self.results[passed[0]].vs_default or 0.0
        near = [n for n in passed if (self.results[n].vs_default or 0.0) * min_speedup >= fastest]
        simplest = min(near, key=lambda n: changes(self.recipes[n]))
        finalists = list(dict.fromkeys([*passed[:FINALISTS], simplest]))
        steps = [
            m.step_ms / 1e3
            for n in (*finalists, default_recipe.name)
            if (m := self.results.get(n)) is not None and m.step_ms is not None
        ]
        if not self.fits((self.setup_s + max(steps, default=0.0) * STEPS) * (len(finalists) + 1)):
            notes.append(
                "no head-to-head round for the finalists (the budget would run out): "
                "ms/step come from rounds measured apart"
            )
            return None
        self.say(f"final round (head to head): {', '.join(finalists)}")
        default = self.trial(default_recipe)
        trials = [self.trial(self.recipes[n]) for n in finalists]
        try:
            self._lockstep(default, [default, *trials], stop_slow=False)
        except Exception:  # the default trained in round 1: leave every figure as it was
            return None
        base = default.median_s()
        if base is None:
            return None
        timed = {t.name: t.median_s() for t in trials if not t.stopped}
        noise = {t.name: t.noise(default) for t in (default, *trials)}
        for name, result in list(self.results.items()):
            mine = base if name == default_recipe.name else timed.get(name)
            if mine is not None:
                self.results[name] = dataclasses.replace(
                    result, step_ms=mine * 1e3, vs_default=base / mine, noise=noise.get(name)
                )
            elif result.status in ("passed", "rejected") and result.step_ms is not None:
                self.results[name] = dataclasses.replace(result, step_ms=None)
        for name in (default_recipe.name, *finalists):
            self.say(f"  {name}: {line(self.results[name])}")
        notes.append(
            "ms/step: the finalists and torch.amp's default raced head to head in a final round; "
            "the others' speed is against the default in their own round"
        )
        return [n for n in finalists if n in timed]

    def best(self, names: Sequence[str], within_memory: bool = True) -> str | None:
        """The fastest of ``names`` that passed (and, with a memory budget and ``within_memory``, fits it)."""
        passed = [n for n in names if n in self.results and self.results[n].status == "passed"]
        if self.fit is not None and within_memory:
            passed = [n for n in passed if self.fit.fits(self.recipes[n])]

        def speed(name: str) -> tuple[bool, float]:  # against the default where it was timed, else by time
            m = self.results[name]
            return (m.vs_default is not None, m.vs_default if m.vs_default is not None else -(m.step_ms or math.inf))

        return max(passed, key=speed, default=None)


def changes(recipe: Recipe) -> int:
    """How far a recipe is from plain torch.autocast (diagnose's kept modules are a constraint, not a change)."""
    moved = bool(recipe.moved_layers)
    if recipe.dtype is torch.float32:
        return 1 + moved
    return len(recipe.fp32_ops) + (recipe.layout != "contiguous") + (recipe.level != "O1") + recipe.compile + moved


def choose(
    search: Search,
    best: str | None,
    torch_default: Recipe,
    dtypes: list[torch.dtype],
    min_speedup: float,
    notes: list[str],
    finalists: list[str] | None,
) -> Recipe:
    """The recipe tune returns: the best measured, unless torch.amp's default is within the bar (``min_speedup``,
    raised to the winner's noise); ``notes`` gains why."""
    if search.out_of_time:
        notes.append(
            "the search left out work that would not have ended inside the budget (a round, a step): "
            "the best recipe measured so far"
        )
    default_result = search.results.get(torch_default.name)
    default_ok = torch_default.dtype in dtypes and default_result is not None and default_result.status == "passed"
    if search.fit is not None and not search.fit.fits(torch_default):
        default_ok = False
        notes.append(f"torch.amp's default is over the memory budget: {search.fit.describe(torch_default)}")
    if default_result is not None and default_result.status == "rejected":
        if default_result.reason.startswith("slower"):
            notes.append(f"torch.amp's default is too slow here: {default_result.reason}")
        else:
            notes.append(f"torch.amp's default fails the accuracy guard: {default_result.reason}")
    winner = search.recipes.get(best) if best is not None else None
    speed = search.results[best].vs_default if best is not None else None
    # A speed-up within the measurements' noise is not one: the bar rises to the chosen candidate's noise.
    need = min_speedup
    if best is not None and best != torch_default.name:
        need = max(min_speedup, 1.0 + (search.results[best].noise or 0.0))
    if best is not None and best != torch_default.name and winner is not None and speed is not None:
        # Within the noise of the fastest, the simplest recipe: fp32 rather than low precision with every matmul
        # moved back to fp32, no op moves rather than some.
        near = [
            n
            for n, m in search.results.items()
            if m.status == "passed"
            and m.vs_default is not None
            and m.vs_default * need >= speed
            and n != torch_default.name
            and search.recipes[n].dtype in dtypes
            and (finalists is None or n in finalists)
            and (search.fit is None or search.fit.fits(search.recipes[n]))
        ]
        simplest: str = min(
            near, key=lambda n: (changes(search.recipes[n]), -(search.results[n].vs_default or 0.0)), default=best
        )
        if simplest != best:
            notes.append(f"{simplest} is within {need:.2f}x of the fastest ({best}) and simpler: chosen")
            best, winner, speed = simplest, search.recipes[simplest], search.results[simplest].vs_default
    if default_ok and (winner is None or speed is None or speed < need):
        if winner is not None and best != torch_default.name and speed is not None and speed >= min_speedup:
            notes.append(
                f"{best} measured {speed:.2f}x torch.amp's default, within the noise of its measurements "
                f"(±{need - 1:.0%}): keeping torch.amp's default"
            )
        elif winner is not None and best != torch_default.name:
            notes.append(
                f"nothing beat torch.amp's default by {min_speedup:.2f}x or more "
                f"(best: {best}, {speed or 0:.2f}x): keeping torch.amp's default"
            )
        else:
            notes.append("nothing beat torch.amp's default: keeping it")
        winner, best = torch_default, torch_default.name
    elif winner is None and search.fit is not None:
        raise ValueError(
            "no recipe that fits the memory budget passed the accuracy guard in the time budget; "
            "give tune more time (budget_s), or more memory"
        )
    elif winner is None:
        notes.append("no candidate passed the accuracy guard in the budget: fp32")
        winner = Recipe(dtype=torch.float32)
    elif winner.dtype is torch.float32:
        notes.append("fp32 was the fastest recipe that passed: no mixed precision on this machine")
    if search.fit is not None and winner is not None:
        gave_up = search.fit.gave_up(winner)
        notes.append(gave_up or f"memory budget: {search.fit.describe(winner)}, within it")
    results = dict(search.results)
    if best in results:
        results[best] = dataclasses.replace(results[best], status="chosen")
    order = {"chosen": 0, "passed": 1, "rejected": 2, "not measured": 3}
    measured = sorted(results.values(), key=lambda m: (order[m.status], -(m.vs_default or 0.0)))
    noises = [m.noise for m in measured if m.noise is not None]
    noise = statistics.median(noises) if noises else None
    if noise is not None and (noise > timing.NOISY or search.repeated):
        notes.append(
            f"timing noise: a candidate's speed against torch.amp's default is known to ±{noise:.0%} "
            "(an approximate 95% interval, median over candidates"
            + ("; the machine is busy)" if noise > timing.NOISY else ")")
            + (
                f"; rounds where a candidate's was over {timing.NOISY:.0%} took up to {search.repeated} steps"
                if search.repeated
                else ""
            )
            + "; a recipe must beat the default by its own noise to be chosen"
        )
    return dataclasses.replace(winner, measurements=tuple(measured), notes=tuple(notes), timing_noise=noise)
