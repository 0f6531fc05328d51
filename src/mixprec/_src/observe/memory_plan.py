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

import contextlib
import dataclasses
import fnmatch
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from mixprec._src import casting
from mixprec._src.amp.autocast import autocast
from mixprec._src.observe.backward_timeline import BackwardTimeline, peak, storage_key
from mixprec._src.optim import cpu_adam, fused_adam, moments
from mixprec._src.policy.rules import default_policy
from mixprec._src.prepare import kept
from mixprec._src.prepare.config import Level, PrepareConfig
from mixprec._src.step import bf16_state, low_bit_state, sliced_gradients, step_in_backward

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
            gradients kept until the step, and the fp32 chunk a norm is taken from); else ``gradients``.
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
        rows = [("weights", self.parameters), ("masters", self.masters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("state (memory_report's total)", self.state)]  # fmt: skip
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
    recipe: PrepareConfig | str | Any = "O2",
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
    lowp, kept_ids = _split(model, config)
    params = _unique(model)
    world = max(1, int(world_size))
    weights = masters = grads = state = 0
    in_flight = largest = largest_gradient = waiting = 0
    grad_bytes: dict[int, int] = {}  # id(param) -> its gradient's bytes
    largest_on = ""
    step_temporary = shadows = 0
    lists: dict[tuple[int, int], int] = {}  # (param group, bytes a value) -> bytes of the tensors torch's foreach steps
    carried: dict[int, int] = {}  # param group -> the denominator torch's for-loop Adam(W) still holds
    cpu_rows: dict[int, int] = {}  # param group -> the bytes of its CPU list step's table
    small = largest_listed = 0  # of those: the small parameters' (stepped together in backward), the largest
    sliced = _sliced(model, optimizer, config, world)
    groups = [] if optimizer is None else optimizer.param_groups
    group_of = {id(q): i for i, g in enumerate(groups) for q in g["params"]}  # id(param) -> its group's index
    for p in params:
        numel = _shard_numel(p, world)
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
            if world == 1 and p.numel() < step_in_backward.SMALL:  # kept until step() where not in a unit
                waiting += grad
            elif made * stored > in_flight:
                in_flight, largest, largest_on = made * stored, made, p.device.type
            grads += grad
            where = group_of.get(id(p))
            group = None if where is None else groups[where]
            state += _state_bytes(p, numel, stored, optimizer, group, config, id(p) in lowp)
            temporary, shadow, form = _step_temporaries(p, numel, stored, optimizer, group, config, id(p) in lowp,
                                                        world)  # fmt: skip
            if form.startswith("cpu-list"):  # a row of its group's table (one step in backward: a table of its own)
                index = cast(int, where)
                cpu_rows[index] = temporary if config.step_in_backward else cpu_rows.get(index, 0) + temporary
                temporary = _LIST_SCALARS[form] + cpu_rows[index]
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
        step_temporary = max(step_temporary, max(small, largest_listed) if config.step_in_backward else
                             _foreach_peak(lists, type(optimizer) is torch.optim.SGD))  # fmt: skip
    if config.step_in_backward:
        # a low-precision gradient's norm is taken a chunk at a time in fp32, but where it lies on the CPU (mixprec's
        # kernel) and on a GPU (CUDA's norm kernel casts as it reads: measured, make gpu-check); a model on the meta
        # device is planned as on the CPU
        if in_flight < largest * 4 and largest_on not in ("cpu", "cuda", "meta"):
            in_flight += min(largest, step_in_backward.NORM_CHUNK) * 4
        grads, in_flight = 0, in_flight + waiting
    activations = checkpointed = backward = None
    names: tuple[str, ...] = ()
    if batch is not None:
        activations, checkpointed, names, (events, of) = _activations(model, config, batch, loss_fn, blocks, lowp,
                                                                      world, plain)  # fmt: skip
        if of is not None:  # stepping in backward each gradient is freed as it is stepped: in flight, counted apart
            sizes = {n: None if config.step_in_backward else grad_bytes.get(i) for n, i in of.items()}
            backward = peak(events, sizes)
    return MemoryPlan(weights, masters, grads, state, in_flight if config.step_in_backward else grads,
                      step_temporary + shadows, activations, checkpointed, names, world,
                      "fp32" if plain else str(config), largest_gradient, backward)  # fmt: skip


def _sliced(model: nn.Module, optimizer: torch.optim.Optimizer | None, config: PrepareConfig,
            world: int) -> dict[int, int]:  # fmt: skip
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


def _config(recipe: Any) -> PrepareConfig | None:
    """The config ``recipe`` prepares with; ``None`` for plain fp32 (``"fp32"``, an fp32 :class:`Recipe`)."""
    if isinstance(recipe, PrepareConfig):
        return recipe
    if recipe == "fp32":
        return None
    if isinstance(recipe, (str, Level)):
        return PrepareConfig(level=recipe)  # type: ignore[arg-type]
    to_config = getattr(recipe, "prepare_config", None)
    if callable(to_config):
        if getattr(recipe, "dtype", None) is torch.float32:
            return None
        config: PrepareConfig = to_config()
        return config
    raise TypeError(f"recipe must be a level, 'fp32', a PrepareConfig or a mixprec.Recipe, "
                    f"not {type(recipe).__name__}")  # fmt: skip


def _unique(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _split(model: nn.Module, config: PrepareConfig) -> tuple[set[int], set[int]]:
    """ids of the parameters the level stores (or computes) in low precision, and of those kept in fp32."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype is not torch.float32]
    if low:
        raise ValueError(f"memory_plan takes the fp32 model prepare will take; {low[0][0]!r} is {low[0][1]}")
    if config.level is Level.O1:
        return set(), set()
    kept_modules = kept.outermost(model, config)
    kept_ids = kept.param_ids(kept_modules)
    inside = {id(m) for k in kept_modules for m in k.modules()}
    lowp = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)
            if p.is_floating_point() and id(p) not in kept_ids}  # fmt: skip
    return lowp, kept_ids


def _shard_numel(p: torch.Tensor, world: int) -> int:
    """Values of rank 0's dim-0 shard (FSDP2 gives the first ranks ``ceil(rows / world)`` rows)."""
    if world == 1 or p.dim() == 0:
        return p.numel()
    rows = -(-p.shape[0] // world)
    return int(rows * math.prod(p.shape[1:]))


def _state_bytes(p: torch.Tensor, numel: int, stored: int, optimizer: torch.optim.Optimizer | None,
                 group: dict[str, Any] | None, config: PrepareConfig, low: bool) -> int:  # fmt: skip
    """Bytes ``optimizer`` keeps for ``p`` (in param group ``group``) after a step, as the level and the state
    precision keep them."""
    if optimizer is None or group is None:
        return 0
    kind = type(optimizer)
    comp = numel * 2 if config.level is Level.BF16_KAHAN and low else 0
    own = config.optimizer_state.own and p.numel() >= moments.MIN_NUMEL  # mixprec's step keeps its state
    bf16 = own and config.optimizer_state == moments.BF16
    step = 4  # a 0-dim fp32 tensor
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        count = 3 if group.get("amsgrad") else 2
        if bf16:
            return count * numel * 2 + step + comp
        if own:
            return count * _codes_bytes(numel, config.optimizer_state) + step + comp
        return count * numel * stored + step + comp
    if kind is torch.optim.SGD:
        if not group.get("momentum"):
            return comp
        if bf16:  # the buffer, and a step count for its rounding's noise
            return numel * 2 + step + comp
        if own:
            return _codes_bytes(numel, config.optimizer_state) + comp
        return numel * stored + comp
    raise ValueError(f"memory_plan knows the state of Adam, AdamW and SGD; this optimizer is a {kind.__name__}")


def _step_temporaries(p: torch.Tensor, numel: int, stored: int, optimizer: torch.optim.Optimizer | None,
                      group: dict[str, Any] | None, config: PrepareConfig, low: bool,
                      world: int) -> tuple[int, int, str]:  # fmt: skip
    """(temporaries the step makes for ``p`` alone, fp32 copies held with every other parameter's, the form of
    the step that takes ``p``: torch's ``"loop"`` or ``"foreach"`` (its temporaries are its list's: the caller
    sums them), ``"cpu-list"`` (mixprec's CPU kernels, a table row for each weight of the group: the caller sums
    them) or ``""`` where mixprec's other kernels step it or no optimizer does)."""
    if optimizer is None or group is None:
        return 0, 0, ""
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    on_cpu = p.device.type in ("cpu", "meta")
    native = on_cpu and fused_adam.NATIVE and cpu_adam.bf16_expected() and p.numel() >= moments.MIN_NUMEL
    if config.optimizer_state.own and native and adam:
        # cpu_adam's kernel reads and writes in place; the group's weights go in one call: a table row each
        return _LIST_ROW[config.optimizer_state], 0, "cpu-list"
    if config.optimizer_state.own and native and type(optimizer) is torch.optim.SGD:  # the same, with SGD's
        return _LIST_ROW["sgd-bf16" if config.optimizer_state == moments.BF16 else "sgd-quantized"], 0, "cpu-list-sgd"
    if config.optimizer_state == moments.BF16 and p.numel() >= moments.MIN_NUMEL:
        # a chunk at a time: its fp32 copies (of a bf16 weight and gradient too) and the update's arrays, and a
        # 0-dim seed; measured
        arrays = (10 if adam else 8) + (2 if config.level.bf16_weights and low else 0)
        return arrays * 4 * min(numel, bf16_state.CHUNK) + 4, 0, ""
    if config.optimizer_state.own and p.numel() >= moments.MIN_NUMEL:
        return (0 if adam else 3 * numel * 4), 0, ""  # the compiled kernel in chunks; SGD's eager fp32 copies
    bf16_step = config.level in (Level.BF16_SR, Level.BF16_KAHAN) and low
    sgd = type(optimizer) is torch.optim.SGD and not (group.get("fused") or group.get("differentiable"))
    if bf16_step and on_cpu and (adam or sgd) and cpu_adam.bf16_expected():  # the group's weights in one call
        return _LIST_ROW["weights"], 0, "cpu-list-sgd" if sgd else "cpu-list-adam"
    if bf16_step and adam:
        return 0, 0, ""  # the fused kernel
    if bf16_step:  # fp32 copies of the weight, its gradient and its state, all held at once
        return 0, numel * 4 * (2 + (1 if type(optimizer) is torch.optim.SGD else 2)), ""
    count, foreach = _torch_temporaries(optimizer, group, p, world)
    return (0 if foreach else count * numel * stored), 0, "foreach" if count and foreach else "loop"


#: bytes of the scalars a CPU list step (``optim/cpu_lists.py``) holds beside its table: seven fp32 values for the
#: state precisions' (``fused_adam.step_scalars``), nine for bf16-sr's and bf16-kahan's Adam, four for SGD's; and
#: of a row of the table (int64 addresses, sizes and seeds: ten a row for quantized moments, nine for bf16 ones,
#: eight for SGD's bf16 momentum, nine for its quantized one, seven for bf16 weights with their own state); measured
_LIST_SCALARS = {"cpu-list": 7 * 4, "cpu-list-adam": 9 * 4, "cpu-list-sgd": 4 * 4}
_LIST_ROW = {
    "8bit": 10 * 8,
    "4bit": 10 * 8,
    "fp8": 10 * 8,
    "bf16": 9 * 8,
    "weights": 7 * 8,
    "sgd-bf16": 8 * 8,
    "sgd-quantized": 9 * 8,
}


def _torch_temporaries(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor,
                       world: int) -> tuple[int, bool]:  # fmt: skip
    """(temporaries of ``p``'s size torch's own step makes, whether it takes its foreach path: its default for
    plain tensors on a GPU, a temporary for every tensor of a list at once), measured:
    tests/observe/test_memory_plan.py. 0 for the fused kernels."""
    if group.get("fused"):
        return 0, False
    foreach = group.get("foreach")
    if foreach is None:  # torch.optim's default: foreach for plain tensors (not FSDP2's DTensors) on a GPU
        device = "cpu" if p.device.type == "meta" else p.device.type
        foreach = not group.get("differentiable") and world == 1 and device in _foreach_devices()
        if isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
            foreach = False
    weight_decay, maximize = bool(group.get("weight_decay")), bool(group.get("maximize"))
    if type(optimizer) is torch.optim.SGD:
        if foreach:  # the gradients with weight decay added (nesterov adds the momentum in place)
            return int(weight_decay or maximize), True
        return int(weight_decay or maximize) + int(bool(group.get("nesterov")) and bool(group.get("momentum"))), False
    if foreach:  # the denominators' list (the gradients with L2 decay added are freed before it)
        return 1, True
    l2 = weight_decay and type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay")
    return 2 + int(l2 or maximize), False  # the denominator and the update, and a gradient with L2 decay or negated


def _foreach_peak(lists: dict[tuple[int, int], int], sgd: bool) -> int:
    """The most bytes torch's foreach step holds at once: a param group's tensors go as lists of one dtype, in
    the order each dtype first comes; Adam(W) keeps a list's denominators until the next list's are made."""
    most = 0
    for group in {g for g, _ in lists}:
        sizes = [size for (g, _), size in lists.items() if g == group]
        most = max(most, *sizes, *([] if sgd else [a + b for a, b in itertools.pairwise(sizes)]))
    return most


def _foreach_devices() -> list[str]:
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return list(_get_foreach_kernels_supported_devices())


def _codes_bytes(numel: int, precision: str) -> int:
    bits, block = moments.FORMATS[precision]
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + blocks * 4


# ----- activations ------------------------------------------------------------------------------


def _default_blocks(model: nn.Module) -> list[str]:
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{child}" if name else child for child, _ in longest.named_children()]


#: a backward run on the fakes: its timeline's events, and the number of each storage a parameter's gradient was
#: in -> id of the parameter (``None``: backward did not run)
_Backward = tuple[list[tuple[int, int]], dict[int, int] | None]


def _activations(model: nn.Module, config: PrepareConfig, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                 blocks: str | Iterable[str] | None, lowp: set[int], world: int,
                 plain: bool) -> tuple[int, int, tuple[str, ...], _Backward]:  # fmt: skip
    """Bytes saved for backward by one forward on fake tensors; and with ``blocks`` checkpointed; and the
    backward on them: its timeline's events and the storages the parameters' gradients were in (:func:`_backward`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = dict(model.named_modules())
    if blocks is None:
        chosen = _default_blocks(model)
    else:
        globs = [blocks] if isinstance(blocks, str) else list(blocks)
        chosen = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)]
    block_ids = {id(names[n]): n for n in chosen}
    current: list[str | None] = [None]
    saved: dict[Any, tuple[int, str | None]] = {}
    timeline = BackwardTimeline()
    block_inputs: dict[str, int] = {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":  # a model built on the meta device plans as on the CPU
        device = torch.device("cpu")
    kept_modules = [] if plain else kept.outermost(model, config)  # kept in fp32 at every level, O1 included
    handles: list[Any] = []

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, contextlib.ExitStack() as stack:
        # O2 on one process computes each module's forward with copies of its own parameters (o2_copies), and a
        # master read outside its module's forward (an attention's out_proj.weight, a tied head) is cast by
        # autocast, a copy saved for backward: the masters stay fp32 here and the same swap puts copies in place.
        # Under FSDP2 every parameter is gathered in low precision: low-precision values throughout.
        swap = config.level is Level.O2 and world == 1
        fake_params: dict[int, torch.Tensor] = {}
        values: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            fake = fake_params.get(id(p))
            if fake is None:
                dtype = config.dtype if id(p) in lowp and not swap else p.dtype
                fake = _fake(mode, p.detach(), device).to(dtype).requires_grad_(p.requires_grad)
                fake_params[id(p)] = fake
            values[name] = fake
        for name, b in model.named_buffers(remove_duplicate=False):
            values[name] = _fake(mode, b, device)
        copies = {id(f): f.detach().to(config.dtype).requires_grad_(f.requires_grad) for i, f in fake_params.items()
                  if swap and i in lowp}  # fmt: skip
        weights = {storage_key(t) for t in (*fake_params.values(), *copies.values())}
        if swap:
            inside = {id(m) for k in kept.outermost(model, config) for m in k.modules()}
            for module in model.modules():
                own = [n for n, q in module._parameters.items() if q is not None and id(q) in lowp]
                if own and id(module) not in inside:
                    _swap_copies(module, own, copies, handles)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key not in weights and key not in saved:
                saved[key] = (t.untyped_storage().nbytes(), current[0])
                timeline.saved(t)
            return t

        for module in model.modules():
            if id(module) in block_ids:
                handles.append(module.register_forward_pre_hook(_enter(current, block_ids[id(module)], block_inputs)))
                handles.append(module.register_forward_hook(_leave(current)))
        kept.keep_in_fp32(kept_modules, device.type, handles)
        stack.callback(lambda: [h.remove() for h in handles])
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        policy = config.policy if config.policy is not None else default_policy(device.type)
        args, kwargs = _inputs(batch, mode)
        with autocast(device.type, dtype=config.dtype, policy=policy, enabled=not plain):  # every level runs in one
            out = torch.func.functional_call(model, values, args, kwargs, tie_weights=True, strict=False)
        if config.output_dtype is not None and not plain:
            out = casting.cast_floating(out, config.output_dtype)
        roots = [loss_fn(out)] if loss_fn is not None else list(_tensors(out))
        del out
        leaves = list(fake_params.items()) + [(i, copies[id(f)]) for i, f in fake_params.items() if id(f) in copies]
        grads = _backward(roots, timeline, leaves)
    total = sum(size for size, _ in saved.values())
    by_block: dict[str | None, int] = {}
    for size, where in saved.values():
        by_block[where] = by_block.get(where, 0) + size
    in_blocks = sum(v for k, v in by_block.items() if k is not None)
    largest = max((v for k, v in by_block.items() if k is not None), default=0)
    checkpointed = total - in_blocks + sum(block_inputs.values()) + largest
    return total, checkpointed, tuple(chosen), (timeline.events, grads)


def _backward(roots: list[Any], timeline: BackwardTimeline,
              leaves: list[tuple[int, torch.Tensor]]) -> dict[int, int] | None:  # fmt: skip
    """Run backward from ``roots`` on the fakes under ``timeline``; the timeline's number of each storage a
    parameter's gradient was in -> id of the parameter (``leaves``: (id of a model parameter, a fake its
    gradient may land on: the fake parameter, or O2's compute copy)); ``None`` where backward cannot run on
    the fakes."""
    roots = [r for r in roots if isinstance(r, torch.Tensor) and r.requires_grad]
    if not roots:
        return None
    made: dict[int, int] = {}

    def arriving(i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:  # a gradient on its way to .grad (a transposed one is copied there)
            number = timeline.number(grad)
            if number is not None:
                made[number] = i

        return hook

    handles = [f.register_hook(arriving(i)) for i, f in leaves if f.requires_grad]  # type: ignore[no-untyped-call]
    try:
        with timeline:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    except Exception:  # an op without a fake backward: the peak falls back on one gradient (MemoryPlan.peak)
        return None
    finally:
        for h in handles:
            h.remove()
    for i, f in leaves:
        number = None if f.grad is None else timeline.number(f.grad)
        if number is not None:
            made[number] = i
    return made


def _fake(mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as a fake tensor (a meta tensor as one on ``device``: its shape, stride and dtype)."""
    if t.device.type == "meta":
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return cast(torch.Tensor, mode.from_tensor(t))


def _swap_copies(module: nn.Module, names: list[str], copies: dict[int, torch.Tensor], handles: list[Any]) -> None:
    """Around ``module``'s forward, its parameters (the fp32 fakes functional_call set) as their copies."""
    held: dict[str, Any] = {}

    def enter(mod: nn.Module, args: Any) -> None:
        for name in names:
            held[name] = mod._parameters[name]
            copy = copies.get(id(held[name]))
            if copy is not None:
                mod._parameters[name] = copy  # type: ignore[assignment]

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        mod._parameters.update(held)

    handles.append(module.register_forward_pre_hook(enter))
    handles.append(module.register_forward_hook(leave))


def _enter(current: list[str | None], name: str, inputs: dict[str, int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        if current[0] is None:
            current[0] = name
            inputs[name] = sum(a.untyped_storage().nbytes() for a in _tensors(args))

    return hook


def _leave(current: list[str | None]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        current[0] = None

    return hook


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _inputs(batch: Any, mode: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def fake(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return mode.from_tensor(value)
        if isinstance(value, (tuple, list)):
            return type(value)(fake(v) for v in value)
        if isinstance(value, dict):
            return {k: fake(v) for k, v in value.items()}
        return value

    if isinstance(batch, dict):
        return (), fake(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(fake(batch)), {}
    return (fake(batch),), {}
