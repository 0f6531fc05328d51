"""One candidate recipe training on a deep copy of the user's model, and its accuracy against fp32's.

A :class:`Trial` steps (forward, backward, optimizer step) with the same random numbers at the same
step as every other trial, times each step with :func:`timing.clock`, and keeps its first losses,
gradients and update; :func:`judge` compares them with the fp32 reference's (see
:class:`Tolerance`). Everything here syncs with the device: it times steps.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._src import input_checks, timing
from mixprec._src.tune.recipe import Recipe, Tolerance

__all__ = ["ACCURACY_STEPS", "Trial", "judge"]

ACCURACY_STEPS = 2  # steps compared with fp32; the first is also the warm-up, never timed


class Trial:
    """One candidate training on a deep copy of the user's model and optimizer."""

    def __init__(
        self,
        recipe: Recipe,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        inputs: Any,
        loss_of: Callable[[Any], torch.Tensor],
        device: torch.device,
    ) -> None:
        self.recipe = recipe
        self.name = recipe.name
        copied_model, copied_optimizer = copy.deepcopy((model, optimizer))  # one memo: the optimizer keeps its params
        # A recipe that steps in backward is measured as its plain twin: the same numbers bit for bit, whose
        # gradients the accuracy guard reads (stepped in backward, they are gone when it looks).
        measured = dataclasses.replace(recipe, step_in_backward=False) if recipe.step_in_backward else recipe
        self.run = measured.apply(copied_model, copied_optimizer)
        self.params = [p for p in self.run.model.parameters() if p.requires_grad]
        self.start = [p.detach().float().clone() for p in self.params]
        self.inputs = self.run.inputs(inputs)
        self.loss_of, self.device = loss_of, device
        self.losses: list[float] = []
        self.times: list[float] = []  # of the current round
        self.grad: torch.Tensor | None = None
        self.update: torch.Tensor | None = None
        self.stopped = ""  # why it stopped early, if it did
        self.failed = ""  # the error it raised, if it did
        self.first_estimate_s = 0.0  # what its first step should take, before it took one (see first_step_s)

    def step(self) -> None:
        # Every candidate draws the same random numbers (dropout) at the same step; the caller's RNG is left alone.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(len(self.times))
            self._step()

    def _step(self) -> None:
        timing.sync(self.device)
        begin = timing.clock()
        self.run.optimizer.zero_grad(set_to_none=True)
        with self.run.autocast():
            loss = self.loss_of(input_checks.call_model(self.run.model, self.inputs))
        self.run.backward(loss)
        first = not self.losses
        if first:  # the gradients fp32's are compared with, before any update (scaled: cosine ignores it)
            self.grad = _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        self.run.step()
        timing.sync(self.device)
        self.times.append(timing.clock() - begin)
        if len(self.losses) < ACCURACY_STEPS:
            self.losses.append(float(loss.detach().float()))
            if len(self.losses) == ACCURACY_STEPS:
                self.update = _flat([p.detach().float() - s for p, s in zip(self.params, self.start, strict=True)])
                self.start = []

    @property
    def checked(self) -> bool:
        return len(self.losses) == ACCURACY_STEPS

    def median_s(self) -> float | None:
        timed = self.times[1:]  # each round's first step is warm-up (first calls, caches, allocations)
        return statistics.median(timed) if timed else None

    def noise(self, default: Trial) -> float | None:
        """How uncertain its speed against ``default`` is in this round, from the per-step ratios (see
        :func:`timing.ratio_noise`; for ``default`` itself, its step time's)."""
        if self is default:
            timed = self.times[1:]
            middle = statistics.median(timed) if timed else 0.0
            return timing.ratio_noise([t / middle for t in timed]) if middle > 0 else None
        pairs = list(zip(default.times[1:], self.times[1:], strict=False))  # the same lockstep steps
        return timing.ratio_noise([d / t for d, t in pairs if t > 0])

    def expected_s(self, default: Trial) -> float:
        """How long the next step should take: its last one, else the default's (or its own estimate)."""
        if self.times:
            return self.times[-1]
        return max(default.times[-1] if default.times else 0.0, self.first_estimate_s)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]) if tensors else torch.zeros(1)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    # in fp64: the norms of millions of squared fp32 values
    a64, b64 = a.double(), b.double()
    denom = float(a64.norm() * b64.norm())
    return float(a64 @ b64) / denom if denom > 0 else (1.0 if float(a64.norm()) == float(b64.norm()) else 0.0)


def judge(trial: Trial, ref: Trial, tol: Tolerance) -> tuple[float | None, float | None, float | None, str]:
    """(loss error, gradient cosine, update cosine, why rejected or ""); the losses of the steps both ran are
    compared (a trial and its reference can end with different numbers on a slow or loaded machine), and a
    trial with none in common, or without a reference's gradient and update, is not judged (its reason says so)."""
    for i, value in enumerate(trial.losses):
        if not math.isfinite(value):
            return None, None, None, f"loss is {value} at step {i + 1}"
    both = min(len(trial.losses), len(ref.losses))
    if not both or trial.grad is None or ref.grad is None or trial.update is None or ref.update is None:
        return None, None, None, "not judged: it and the fp32 reference have no finished steps in common"
    err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(trial.losses[:both], ref.losses[:both], strict=True))
    if not bool(torch.isfinite(trial.grad).all()):
        return err, None, None, "non-finite gradients at step 1"
    gcos, ucos = _cosine(trial.grad, ref.grad), _cosine(trial.update, ref.update)
    if err > tol.loss_rtol:
        return err, gcos, ucos, f"loss differs from fp32 by {err:.2%} > {tol.loss_rtol:.2%}"
    if gcos < tol.grad_cos:
        return err, gcos, ucos, f"gradient cosine {gcos:.5f} < {tol.grad_cos}"
    if ucos < tol.update_cos:
        return err, gcos, ucos, f"update cosine {ucos:.4f} < {tol.update_cos}"
    return err, gcos, ucos, ""
