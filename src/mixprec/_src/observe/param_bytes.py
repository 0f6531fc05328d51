"""What a recipe holds per parameter, in bytes, from its shape alone: weights, masters, gradients, optimizer state
and the temporaries of the optimizer's step (torch's for-loop, foreach and fused forms, mixprec's CPU lists).

``memory_plan`` sums these over the model; each function here answers for one parameter (or one param
group's lists). Plain arithmetic on shapes and dtypes: nothing is allocated, nothing syncs.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from mixprec._src.optim import aten_lists, cpu_adam, fused_adam, fused_lists, moments
from mixprec._src.prepare import kept
from mixprec._src.prepare.config import Level, PrepareConfig
from mixprec._src.step import bf16_state, own_step

__all__ = [
    "LIST_ROW",
    "LIST_SCALARS",
    "codes_bytes",
    "foreach_peak",
    "shard_numel",
    "split",
    "state_bytes",
    "step_temporaries",
    "unique_params",
]


def unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def split(model: nn.Module, config: PrepareConfig) -> tuple[set[int], set[int]]:
    """ids of the parameters the level stores (or computes) in low precision, and of those kept in fp32."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype is not torch.float32]
    if low:
        raise ValueError(f"memory_plan takes the fp32 model prepare will take; {low[0][0]!r} is {low[0][1]}")
    if config.level is Level.O1:
        return set(), set()
    kept_modules = kept.outermost(model, config)
    kept_ids = kept.param_ids(kept_modules)
    inside = {id(m) for k in kept_modules for m in k.modules()}
    lowp = {
        id(p)
        for m in model.modules()
        if id(m) not in inside
        for p in m.parameters(recurse=False)
        if p.is_floating_point() and id(p) not in kept_ids
    }
    return lowp, kept_ids


def shard_numel(p: torch.Tensor, world: int) -> int:
    """Values of rank 0's dim-0 shard (FSDP2 gives the first ranks ``ceil(rows / world)`` rows)."""
    if world == 1 or p.dim() == 0:
        return p.numel()
    rows = -(-p.shape[0] // world)
    return int(rows * math.prod(p.shape[1:]))


def state_bytes(
    p: torch.Tensor,
    numel: int,
    stored: int,
    optimizer: torch.optim.Optimizer | None,
    group: dict[str, Any] | None,
    config: PrepareConfig,
    low: bool,
) -> int:
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
            return count * codes_bytes(numel, config.optimizer_state) + step + comp
        return count * numel * stored + step + comp
    if kind is torch.optim.SGD:
        if not group.get("momentum"):
            return comp
        if bf16:  # the buffer, and a step count for its rounding's noise
            return numel * 2 + step + comp
        if own:
            return codes_bytes(numel, config.optimizer_state) + comp
        return numel * stored + comp
    raise ValueError(f"memory_plan knows the state of Adam, AdamW and SGD; this optimizer is a {kind.__name__}")


def step_temporaries(
    p: torch.Tensor,
    numel: int,
    stored: int,
    optimizer: torch.optim.Optimizer | None,
    group: dict[str, Any] | None,
    config: PrepareConfig,
    low: bool,
    world: int,
    prepared: bool = True,
) -> tuple[int, int, str]:
    """(temporaries the step makes for ``p`` alone, fp32 copies held with every other parameter's, the form of
    the step that takes ``p``: torch's ``"loop"`` or ``"foreach"`` (its temporaries are its list's: the caller
    sums them), ``"cpu-list"`` (mixprec's CPU kernels, a table row for each weight of the group: the caller sums
    them) or ``""`` where mixprec's other kernels step it or no optimizer does; ``prepared``: by ``prepare``,
    else plain torch)."""
    if optimizer is None or group is None:
        return 0, 0, ""
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    on_cpu = p.device.type in ("cpu", "meta")
    native = on_cpu and fused_adam.NATIVE and cpu_adam.bf16_expected() and p.numel() >= moments.MIN_NUMEL
    if config.optimizer_state.own and native and adam:
        # cpu_adam's kernel reads and writes in place; the group's weights go in one call: a table row each
        return LIST_ROW[config.optimizer_state], 0, "cpu-list"
    if config.optimizer_state.own and native and type(optimizer) is torch.optim.SGD:  # the same, with SGD's
        return LIST_ROW["sgd-bf16" if config.optimizer_state == moments.BF16 else "sgd-quantized"], 0, "cpu-list-sgd"
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
        return LIST_ROW["weights"], 0, "cpu-list-sgd" if sgd else "cpu-list-adam"
    if bf16_step and adam:
        return 0, 0, ""  # the fused kernel
    if bf16_step:  # fp32 copies of the weight, its gradient and its state, all held at once
        return 0, numel * 4 * (2 + (1 if type(optimizer) is torch.optim.SGD else 2)), ""
    # the optimizer's own Adam(W) or SGD of what no other stage takes, a param group in one call (step.own_step)
    if prepared and on_cpu and world == 1 and own_step.takes_group(optimizer, group):
        decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
        if adam and group.get("fused"):  # torch's fused arithmetic (O2's copies written beside fp32 weights)
            if stored == 4 and fused_lists.expected():
                return LIST_ROW["fused"], 0, "cpu-list-fused"
            if stored == 2 and fused_lists.expected(torch.bfloat16):  # bf16-pure's: after the fp32 ones' table
                return LIST_ROW["fused"], 0, "cpu-list-fused-bf16"
        elif adam and stored == 4 and aten_lists.expected():
            return LIST_ROW["aten"], 0, "cpu-list-aten"
        elif adam and stored == 2:  # bf16-pure's weights: another table, made after the fp32 ones'
            if aten_lists.supports(group, torch.bfloat16, decoupled) and aten_lists.expected(torch.bfloat16):
                return LIST_ROW["aten"], 0, "cpu-list-aten-bf16"
        elif not adam and stored == 4 and aten_lists.sgd_expected():
            return LIST_ROW["sgd-fp32"], 0, "cpu-list-sgd-fp32"
        elif not adam and stored == 2 and aten_lists.sgd_bf16_expected():  # bf16-pure's: after the fp32 ones' table
            return LIST_ROW["sgd-aten-bf16"], 0, "cpu-list-sgd-aten-bf16"
    count, foreach = _torch_temporaries(optimizer, group, p, world)
    return (0 if foreach else count * numel * stored), 0, "foreach" if count and foreach else "loop"


#: bytes of the scalars a CPU list step (``optim/cpu_lists.py``, ``optim/aten_lists.py``) holds beside its table:
#: seven fp32 values for the state precisions' (``fused_adam.step_scalars``) and for torch's Adam(W) of fp32 and
#: bf16 weights, nine for bf16-sr's and bf16-kahan's Adam, four for SGD's (of bf16 or fp32 weights); and of a row of
#: the table (int64 addresses, sizes, seeds and positions: ten a row for quantized and bf16 moments, eight for SGD's
#: bf16 momentum, nine for its quantized one, seven for bf16 weights with their own state and for SGD's fp32
#: weights, five for Adam(W)'s fp32 and bf16 weights and for SGD's bf16 ones (whose scalars are five), six for Adam(W)'s
#: fused form's fp32 weights); measured
LIST_SCALARS = {
    "cpu-list": 7 * 4,
    "cpu-list-adam": 9 * 4,
    "cpu-list-sgd": 4 * 4,
    "cpu-list-aten": 7 * 4,
    "cpu-list-aten-bf16": 7 * 4,
    "cpu-list-fused": 7 * 4,
    "cpu-list-fused-bf16": 7 * 4,
    "cpu-list-sgd-fp32": 4 * 4,
    "cpu-list-sgd-aten-bf16": 5 * 4,
}
LIST_ROW = {
    "8bit": 10 * 8,
    "4bit": 10 * 8,
    "fp8": 10 * 8,
    "bf16": 10 * 8,
    "weights": 7 * 8,
    "sgd-bf16": 8 * 8,
    "sgd-quantized": 9 * 8,
    "aten": 5 * 8,
    "fused": 6 * 8,
    "sgd-fp32": 7 * 8,
    "sgd-aten-bf16": 5 * 8,
}


def _torch_temporaries(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, world: int
) -> tuple[int, bool]:
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


def foreach_peak(lists: dict[tuple[int, int], int], sgd: bool) -> int:
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


def codes_bytes(numel: int, precision: str) -> int:
    bits, block = moments.FORMATS[precision]
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + blocks * 4
