"""The optimizer's step at a precision level, planned once from what prepare was asked for, and installed once.

A :class:`StepPlan` is the step's four choices, as data:

* ``write``: how a low-precision weight is written with its update: ``"nearest"`` (and every fp32 weight),
  ``"stochastic"`` (bf16-sr's noise) or ``"kahan"`` (bf16-kahan's compensation);
* ``state``: how the optimizer state is stored: ``"fp32"`` (as the weights are: bf16 beside bf16 weights),
  ``"bf16"`` (stochastically rounded), ``"8bit"``, ``"4bit"``, ``"fp8"`` (block-wise quantized);
* ``in_backward``: whether each parameter steps in backward as its gradient is whole;
* ``optimizer``: ``"adam"`` (torch's Adam or AdamW), ``"sgd"`` (torch's SGD) or ``"other"``.

:func:`install` puts it on the optimizer. Which kernel steps what follows from the plan
(:meth:`StepPlan.kernels` says it in words): on the CPU a param group's weights go in one call of
``optim.cpu_lists`` (Adam(W) and SGD, every write rule and state precision);
elsewhere a compiled kernel a weight; an optimizer mixprec has no kernel for steps fp32 copies with its own code.
Everything is installed inside the optimizer's own ``step`` (its ``_init_group``, which ``step`` calls once
per param group), so its hooks, profiler label and LR schedulers stay, in this order, each stage handing the
parameters it does not take to the next:

1. clipping (a step pre-hook, after a GradScaler's unscale);
2. the state precision's step (the large weights of Adam(W) and SGD);
3. the write rule's step (the other low-precision weights of Adam(W); any optimizer's, on fp32 copies);
4. torch's own step (fp32 weights, and the rest): on the CPU, Adam(W)'s and SGD's for-loop and foreach steps of
   the fp32 weights (and Adam(W)'s of bf16-pure's bf16 ones), and fused Adam(W)'s of the fp32 weights (O2's copies
   written beside), in one call a param group (``step.own_step``, bit for bit torch's);
5. in backward, the per-parameter hooks that run 2-4 for one parameter as its gradient is whole.

Nothing here syncs with the device: the seeds and step counts are host integers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mixprec._src.optim import cpu_lists, moments
from mixprec._src.optim.state_precision import StatePrecision
from mixprec._src.step import kahan, low_bit_state, own_step, sr_noise, state_dicts, stochastic_rounding
from mixprec._src.step import step_in_backward as in_backward

__all__ = ["WRITES", "StepPlan", "install", "narrow_state"]

#: how a low-precision weight is written
WRITES = ("nearest", "stochastic", "kahan")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the optimizer's step does at a level (see the module).

    Attributes:
        write: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
        state: ``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"`` or ``"fp8"``.
        in_backward: each parameter steps in backward.
        optimizer: ``"adam"``, ``"sgd"`` or ``"other"``.
        clip: the global gradient norm clipped to before each step, or ``None``.
        bf16_weights: the level stores its low-precision weights in bf16 (their state too, at ``"fp32"``).
    """

    write: str = "nearest"
    state: StatePrecision = StatePrecision.FP32
    in_backward: bool = False
    optimizer: str = "other"
    clip: float | None = None
    bf16_weights: bool = False

    def __post_init__(self) -> None:
        if self.write not in WRITES:
            raise ValueError(f"a step writes its weights {', '.join(map(repr, WRITES))}; not {self.write!r}")
        object.__setattr__(self, "state", StatePrecision.from_name(self.state))

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, **choices: Any) -> StepPlan:
        """The plan for ``optimizer`` (its kind read from its class) and the other choices."""
        kind = type(optimizer)
        named = (
            "adam" if kind in (torch.optim.Adam, torch.optim.AdamW) else "sgd" if kind is torch.optim.SGD else "other"
        )
        return cls(optimizer=named, **choices)

    @property
    def seeded(self) -> bool:
        """Whether something rounds stochastically (the weights, or bf16 moments): a seed is drawn at prepare."""
        return self.write == "stochastic" or self.state == moments.BF16

    def kernels(self) -> str:
        """Which kernel steps what, in words (on the CPU; elsewhere a compiled kernel a weight stands for a list)."""
        parts = []
        lists = cpu_lists.available()
        if self.state.own:  # Adam(W) and SGD only (prepare refuses the others)
            how = "in one call a param group" if lists else "a weight at a time"
            parts.append(f"weights of 4096 values or more with {self.state} state {how}")
        if self.bf16_weights and self.write != "nearest":
            how = "in one call a param group" if lists and self.optimizer != "other" else "on fp32 copies"
            parts.append(f"bf16 weights written {self.write} {how}")
        if self.optimizer != "other" and lists:
            parts.append("the rest of a for-loop, foreach or fused Adam(W) step in one call a param group (as torch's)")
        parts.append("the rest by the optimizer's own step")
        when = "in backward, a parameter at a time" if self.in_backward else "after backward"
        return f"{'; '.join(parts)}; {when}"


def narrow_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """The optimizer state the bf16 weights already have (a warm-up step, a checkpoint loaded before prepare)
    stored in ``dtype`` too, as the state these levels create (and as exactly as a bf16 run's saved state
    reloads): else it stays fp32, the memory the level saves is lost and the run drifts from one that
    started prepared."""
    for param in params:
        state = optimizer.state.get(param)
        if state is not None and moments.is_quantized(state):  # codes and fp32 scales stay as stored
            continue
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0 and key != "step":
                state[key] = value.to(dtype)  # type: ignore[index]


def install(
    plan: StepPlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lowp: Sequence[torch.Tensor],
    handles: list[Any],
    *,
    group: Any = None,
    slices: bool = True,
    copies: Any = None,
) -> bool:
    """Put ``plan`` on ``optimizer`` (``lowp``: the low-precision weights; ``group``: the process group of a
    sharded model, whose ranks share one seed; ``slices``: the step in backward may take a large weight's gradient
    a slice at a time; ``copies``: O2's compute copies, which the state precisions' list kernels and the own step of
    fused Adam(W) write with their masters). Each stage's handles go to ``handles``. Returns whether Adam(W)'s fused
    kernel steps the bf16 weights. A collective where the model is sharded and something rounds stochastically (one
    broadcast of the seed)."""
    if plan.clip is not None and not plan.in_backward:  # before bf16-sr's widening
        in_backward.clip_before_step(optimizer, plan.clip, handles)
    if plan.bf16_weights:
        narrow_state(optimizer, lowp, torch.bfloat16)
    # the seed and step counters every prepared optimizer's checkpoint holds (0 where nothing rounds stochastically)
    seed = sr_noise.draw_seed(group) if plan.seeded else 0
    stochastic_rounding.add_counters(optimizer, seed, handles)
    fused = False
    if plan.bf16_weights and plan.write == "stochastic":
        fused = stochastic_rounding.install(optimizer, lowp, handles)
    elif plan.bf16_weights and plan.write == "kahan":
        fused = kahan.install(optimizer, lowp, handles)
    if plan.state.own:  # wraps the write rule's step: it takes the large weights, hands it the rest
        low_bit_state.install(optimizer, plan.state, handles, plan.write if plan.bf16_weights else "nearest", copies)
    else:  # a checkpoint of quantized state loads as the level's moments
        state_dicts.dequantize_on_load(optimizer, handles)
    # outermost: the fp32 weights every stage above hands on to torch's own Adam(W) or SGD, in one call on the CPU
    own_step.install(optimizer, handles, copies)
    if plan.in_backward:  # after every change to the optimizer's step: it steps with all of them
        in_backward.install(model, optimizer, plan.clip, handles, slices=slices)
    return fused
