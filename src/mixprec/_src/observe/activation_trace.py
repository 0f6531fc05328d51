"""The activations a forward saves for backward, and what the backward makes beyond them, traced on fake tensors.

``memory_plan``'s activation terms: the model's forward (and ``loss_fn``) run under the recipe's autocast on
``FakeTensorMode`` tensors (no memory, no compute), with and without activation checkpointing of its blocks;
the saved tensors are counted once per storage, the weights they are not, and the backward's events go to
``observe.backward_timeline``. Nothing runs for real; nothing syncs.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from mixprec._src import casting
from mixprec._src.amp.autocast import autocast
from mixprec._src.observe.backward_timeline import BackwardTimeline, storage_key
from mixprec._src.policy.rules import default_policy
from mixprec._src.prepare import kept, o2_copies
from mixprec._src.prepare.config import Level, PrepareConfig

__all__ = ["activations"]


def _default_blocks(model: nn.Module) -> list[str]:
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{child}" if name else child for child, _ in longest.named_children()]


#: a backward run on the fakes: its timeline's events, and the number of each storage a parameter's gradient was
#: in -> id of the parameter (``None``: backward did not run)
_Backward = tuple[list[tuple[int, int]], dict[int, int] | None]


def activations(
    model: nn.Module,
    config: PrepareConfig,
    batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    blocks: str | Iterable[str] | None,
    lowp: set[int],
    world: int,
    plain: bool,
) -> tuple[int, int, tuple[str, ...], _Backward]:
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
        # O2 on one process computes with copies of the parameters (o2_copies): a training forward puts torch
        # layers' copies in place for the model's whole call (an attention's out_proj.weight, a tied head read
        # outside their layer's call are copies too), other modules' around their own call (a master read outside
        # it is cast by autocast, a copy saved for backward): the masters stay fp32 here and the same swaps put
        # copies in place. fp8 gives layers forwards of their own: with it, each swaps around its own call.
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
        copies = {
            id(f): f.detach().to(config.dtype).requires_grad_(f.requires_grad)
            for i, f in fake_params.items()
            if swap and i in lowp
        }
        weights = {storage_key(t) for t in (*fake_params.values(), *copies.values())}
        if swap:
            inside = {id(m) for k in kept.outermost(model, config) for m in k.modules()}
            for module in model.modules():
                own = [n for n, q in module._parameters.items() if q is not None and id(q) in lowp]
                if own and id(module) not in inside:
                    whole = config.fp8 is None and o2_copies.swapped_whole(module)
                    _swap_copies(model if whole else module, own, copies, handles, owner=module if whole else None)
            # fp8 conversion routes each attention: its out_proj then runs as a module, on its own copy
            for module in model.modules() if config.fp8 is not None else ():
                if isinstance(module, nn.MultiheadAttention) and id(module) not in inside:
                    proj = module.out_proj
                    own = [n for n, q in proj._parameters.items() if q is not None and id(q) in lowp]
                    _swap_copies(module, own, copies, handles, owner=proj)

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


def _backward(
    roots: list[Any], timeline: BackwardTimeline, leaves: list[tuple[int, torch.Tensor]]
) -> dict[int, int] | None:
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


def _swap_copies(
    module: nn.Module,
    names: list[str],
    copies: dict[int, torch.Tensor],
    handles: list[Any],
    owner: nn.Module | None = None,
) -> None:
    """Around ``module``'s forward, ``owner``'s (default: its own) parameters (the fp32 fakes functional_call set)
    as their copies."""
    held: dict[str, Any] = {}
    holder = module if owner is None else owner

    def enter(mod: nn.Module, args: Any) -> None:
        for name in names:
            held[name] = holder._parameters[name]
            copy = copies.get(id(held[name]))
            if copy is not None:
                holder._parameters[name] = copy  # type: ignore[assignment]

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        holder._parameters.update(held)

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
