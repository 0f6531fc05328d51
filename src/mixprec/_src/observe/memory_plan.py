"""Know before you run: the bytes a recipe will hold per rank, from the model's shapes alone.

``mixprec.memory_plan(model, optimizer, recipe, batch=..., world_size=...)`` predicts what
:func:`mixprec.memory_report` will count after a step (weights, masters, gradients, optimizer
state: each term from the parameters' shapes, the level's storage dtypes, the modules it keeps in
fp32, the optimizer's state and its precision, and FSDP2's dim-0 shards of rank 0, the largest)
and the activations one forward saves for backward, measured on fake tensors (no memory, no
compute: ``torch._subclasses.FakeTensorMode``) under the recipe's autocast, with and without
activation checkpointing of the model's blocks, and what the backward on the same fakes makes
beyond them at its worst op (``observe.backward_timeline``). Nothing is prepared, copied or run for
real; nothing syncs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from mixprec._src.observe import activation_trace
from mixprec._src.observe.backward_timeline import peak
from mixprec._src.observe.param_bytes import (
    LIST_SCALARS,
    foreach_peak,
    shard_numel,
    split,
    state_bytes,
    step_temporaries,
    unique_params,
)
from mixprec._src.prepare.config import Level, PrepareConfig
from mixprec._src.step import low_bit_state, sliced_gradients, step_in_backward

__all__ = ["MemoryPlan", "memory_plan"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank will hold, predicted (see :func:`mixprec.memory_plan`).

    Attributes:
        parameters, masters, gradients, optimizer_state: what :func:`mixprec.memory_report` counts
            after a step (the same meanings; gradients are 0 where the step runs in backward).
        gradients_in_flight: the most gradient bytes alive at once during backward where the step
            runs in backward (the largest parameter's gradient, or its slice, the small parameters'
            gradients kept until the step, and the fp32 chunk a norm is taken from; on one process without
            clipping, the gradients held in the step's bucket beside the largest: at most
            ``step_in_backward.BUCKET`` bytes more, at most all of them); else ``gradients``.
        transient: the most bytes the optimizer step makes and frees: torch's own Adam(W) makes two
            temporaries of a parameter's size (the square root and the division), SGD one; the compiled
            kernels (quantized state, bf16-sr's and bf16-kahan's Adam) none; bf16 levels stepping another
            optimizer through fp32 copies make those copies for every bf16 parameter at once.
        activations: bytes the forward saves for backward (``None`` without a batch).
        activations_checkpointed: the same with each block's activations recomputed in backward
            (``checkpoint``): the blocks' inputs, the largest block's own, and the rest.
        blocks: the modules counted as blocks for ``activations_checkpointed``.
        world_size, recipe: what the plan is for.
        largest_gradient: the largest parameter's gradient, whole.
        backward: the most bytes backward holds at once beyond the activations still saved: the
            gradients of activations in flight, ops' results, and the parameters' gradients made so far
            (left out where the step runs in backward: ``gradients_in_flight`` counts those); ``None``
            without a batch, or where backward cannot run on fake tensors.
    """

    parameters: int
    masters: int
    gradients: int
    optimizer_state: int
    gradients_in_flight: int
    transient: int
    activations: int | None
    activations_checkpointed: int | None
    blocks: tuple[str, ...]
    world_size: int
    recipe: str
    largest_gradient: int = 0
    backward: int | None = None

    @property
    def state(self) -> int:
        """What :func:`mixprec.memory_report`'s ``total`` will be after a step."""
        return self.parameters + self.masters + self.gradients + self.optimizer_state

    @property
    def peak(self) -> int | None:
        """The most bytes alive at once over a step, activations included (``None`` without a batch).

        Stepping after backward, the larger of the step (every gradient, and the step's temporaries) and
        backward's worst moment (the state without gradients, every activation, and ``backward``); stepping in
        backward, the state, every activation, ``backward``, the gradient in flight and the step's temporaries.
        Measured against the process's resident peak (one sequence) within 1% on the bench transformer,
        MLP and checkerboard at thirteen recipes; a kernel's own scratch memory is not seen (oneDNN's bf16
        convolutions: docs/memory.md).
        """
        if self.activations is None:
            return None
        if self.gradients == 0:  # stepped in backward
            return self.state + self.activations + (self.backward or 0) + self.gradients_in_flight + self.transient
        held = self.largest_gradient if self.backward is None else self.backward
        return max(self.state + self.transient, self.state - self.gradients + self.activations + held)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "state": self.state, "peak": self.peak}

    def __str__(self) -> str:
        rows = [
            ("weights", self.parameters),
            ("masters", self.masters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("state (memory_report's total)", self.state),
        ]
        if self.activations is not None:
            rows.append(("activations", self.activations))
            if self.backward is not None:
                rows.append(("backward, beyond the activations", self.backward))
            rows.append(("peak", self.peak or 0))
        if self.activations_checkpointed is not None and self.blocks:
            rows.append((f"activations, {len(self.blocks)} blocks checkpointed", self.activations_checkpointed))
        width = max(len(name) for name, _ in rows)
        lines = [f"memory plan: {self.recipe}, per rank of {self.world_size}"]
        lines += [f"  {name:<{width}}  {value / _MIB:10.1f} MiB" for name, value in rows]
        return "\n".join(lines)


def memory_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    recipe: PrepareConfig | Level | str | Prepares = "O2",
    *,
    batch: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    world_size: int = 1,
    blocks: str | Iterable[str] | None = None,
) -> MemoryPlan:
    """Predict the bytes per rank that ``recipe`` will hold for ``model`` and ``optimizer``.

    Args:
        model: the fp32 model, as it will be passed to :func:`mixprec.prepare` (not sharded yet); on the
            ``meta`` device too (a model too large to build: planned as on the CPU).
        optimizer: the optimizer it will step (Adam, AdamW or SGD: their state is known), or ``None``.
        recipe: a level (``"O2"``), a :class:`PrepareConfig`, a :class:`mixprec.Recipe`, or ``"fp32"`` (no
            mixed precision).
        batch: the forward's inputs (a tensor, a tuple of positional ones or a dict of keyword ones):
            only their shapes and dtypes are used. Without it, activations are not predicted.
        loss_fn: ``loss_fn(output) -> loss``, whose saved tensors count too (a cross-entropy saves its
            logits).
        world_size: ranks FSDP2 will shard every parameter over (dim 0; rank 0 holds the largest shard).
        blocks: qualified-name globs of the modules that activation checkpointing would wrap (default: the
            children of the model's longest ``nn.ModuleList``, its layers).

    Raises:
        ValueError: an optimizer whose state is not known, a model not in fp32.
    """
    config = _config(recipe)
    plain = config is None
    if config is None:  # plain fp32: O1's bytes (fp32 weights, gradients and state), no autocast
        config = PrepareConfig(level=Level.O1)
    lowp, kept_ids = split(model, config)
    params = unique_params(model)
    world = max(1, int(world_size))
    weights = masters = grads = state = 0
    in_flight = largest = largest_gradient = waiting = 0
    grad_bytes: dict[int, int] = {}  # id(param) -> its gradient's bytes
    largest_on = ""
    step_temporary = shadows = 0
    lists: dict[tuple[int, int], int] = {}  # (param group, bytes a value) -> bytes of the tensors torch's foreach steps
    carried: dict[int, int] = {}  # param group -> the denominator torch's for-loop Adam(W) still holds
    cpu_rows: dict[tuple[int, str], int] = {}  # (param group, form) -> the bytes of that CPU list step's table
    small = largest_listed = 0  # of those: the small parameters' (stepped together in backward), the largest
    # stepping in backward on one process without clipping, whole gradients wait in a bucket (step_in_backward.BUCKET)
    bucket = config.step_in_backward and world == 1 and config.clip_grad_norm is None
    alone = config.step_in_backward and not bucket  # a CPU list step of one parameter: a table of its own
    held = largest_held = 0  # the gradients that go in the bucket (not those made a slice at a time): all, largest
    sliced = _sliced(model, optimizer, config, world)
    groups = [] if optimizer is None else optimizer.param_groups
    group_of = {id(q): i for i, g in enumerate(groups) for q in g["params"]}  # id(param) -> its group's index
    for p in params:
        numel = shard_numel(p, world)
        stored = 4 if config.level is Level.O1 or id(p) in kept_ids or id(p) not in lowp else 2
        if config.level is Level.O2 and id(p) in lowp:
            masters += numel * 4
            weights += numel * 2  # the compute copy (FSDP2 gathers it instead: 0 between steps)
            stored = 4
            if world > 1:
                weights -= numel * 2
        else:
            weights += numel * stored
        if p.requires_grad:
            grad = numel * stored
            grad_bytes[id(p)] = grad
            largest_gradient = max(largest_gradient, grad)
            made = sliced.get(id(p), numel)  # values of its gradient alive at once in backward
            if bucket and id(p) not in sliced:
                held, largest_held = held + grad, max(largest_held, grad)
            if world == 1 and p.numel() < step_in_backward.SMALL:  # kept until step() where not in a unit
                waiting += grad
            elif made * stored > in_flight:
                in_flight, largest, largest_on = made * stored, made, p.device.type
            grads += grad
            where = group_of.get(id(p))
            group = None if where is None else groups[where]
            state += state_bytes(p, numel, stored, optimizer, group, config, id(p) in lowp)
            temporary, shadow, form = step_temporaries(
                p, numel, stored, optimizer, group, config, id(p) in lowp, world, prepared=not plain
            )
            if form.startswith("cpu-list"):  # a row of its group's table (one step in backward: a table of its own)
                table = (cast(int, where), form)  # each stage's table is made and freed before the next stage's
                cpu_rows[table] = temporary if alone else cpu_rows.get(table, 0) + temporary
                temporary = LIST_SCALARS[form] + cpu_rows[table]
            elif form == "foreach":  # one temporary per tensor of its list, all alive at once: summed below
                key = (cast(int, where), stored)
                lists[key] = lists.get(key, 0) + numel * stored
                small = small + numel * stored if world == 1 and p.numel() < step_in_backward.SMALL else small
                largest_listed = max(largest_listed, numel * stored)
            elif form == "loop" and temporary > 0 and not config.step_in_backward:
                # torch's for-loop keeps the last parameter's denominator until it makes this one's
                temporary += carried.get(cast(int, where), 0)
                carried[cast(int, where)] = numel * stored if type(optimizer) is not torch.optim.SGD else 0
            step_temporary, shadows = max(step_temporary, temporary), shadows + shadow
    if lists:  # stepping in backward, a parameter's list is itself, or the small parameters stepped together
        step_temporary = max(
            step_temporary,
            min(sum(lists.values()), largest_listed + step_in_backward.BUCKET)
            if bucket
            else max(small, largest_listed)
            if config.step_in_backward
            else foreach_peak(lists, type(optimizer) is torch.optim.SGD),
        )
    if config.step_in_backward:
        # a low-precision gradient's norm is taken a chunk at a time in fp32, but where it lies on the CPU (mixprec's
        # kernel) and on a GPU (CUDA's norm kernel casts as it reads: measured, make gpu-check); a model on the meta
        # device is planned as on the CPU
        if in_flight < largest * 4 and largest_on not in ("cpu", "cuda", "meta"):
            in_flight += min(largest, step_in_backward.NORM_CHUNK) * 4
        # with a bucket, its bytes at most wait beside the gradient being made (a slice steps the bucket first);
        # without, the small parameters' wait for the step
        in_flight = max(in_flight, min(held, largest_held + step_in_backward.BUCKET)) if bucket else in_flight + waiting
        grads = 0
    activations = checkpointed = backward = None
    names: tuple[str, ...] = ()
    if batch is not None:
        traced = activation_trace.activations(model, config, batch, loss_fn, blocks, lowp, world, plain)
        activations, checkpointed, names, (events, of) = traced
        if of is not None:  # stepping in backward each gradient is freed as it is stepped: in flight, counted apart
            sizes = {n: None if config.step_in_backward else grad_bytes.get(i) for n, i in of.items()}
            backward = peak(events, sizes)
    return MemoryPlan(
        weights,
        masters,
        grads,
        state,
        in_flight if config.step_in_backward else grads,
        step_temporary + shadows,
        activations,
        checkpointed,
        names,
        world,
        "fp32" if plain else str(config),
        largest_gradient,
        backward,
    )


def _sliced(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, config: PrepareConfig, world: int
) -> dict[int, int]:
    """id(weight) -> the values of its gradient alive at once, where prepare will make it a slice at a time
    (``step.sliced_gradients``: the step in backward with quantized Adam(W) state, one process, not O2)."""
    if not config.step_in_backward or world > 1 or config.level is Level.O2 or not config.optimizer_state.own:
        return {}
    if config.fp8 is not None:  # converted layers keep their forward and whole gradients: all counted whole
        return {}
    found = sliced_gradients.sliceable_weights(model, route=False).values()
    blocks = {id(w): low_bit_state.slice_block(config.optimizer_state, optimizer, w) for _, w in found}
    return {id(w): sliced_gradients.alive(w, blocks[id(w)]) for _, w in found if blocks[id(w)]}


# ----- the recipe ------------------------------------------------------------------------------


@runtime_checkable
class Prepares(Protocol):
    """What the plan reads of a :class:`mixprec.Recipe` (a higher subsystem, which plans with this module): its
    dtype and the config it prepares with."""

    @property
    def dtype(self) -> torch.dtype: ...

    def prepare_config(self, device_type: str = "cpu") -> PrepareConfig: ...


def _config(recipe: PrepareConfig | Level | str | Prepares) -> PrepareConfig | None:
    """The config ``recipe`` prepares with; ``None`` for plain fp32 (``"fp32"``, an fp32 :class:`Recipe`)."""
    if isinstance(recipe, PrepareConfig):
        return recipe
    if recipe == "fp32":
        return None
    if isinstance(recipe, (str, Level)):
        return PrepareConfig(level=Level.from_name(recipe))
    if isinstance(recipe, Prepares):
        return None if recipe.dtype is torch.float32 else recipe.prepare_config()
    raise TypeError(f"recipe must be a level, 'fp32', a PrepareConfig or a mixprec.Recipe, not {type(recipe).__name__}")
