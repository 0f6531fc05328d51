"""Adam(W)'s moments and SGD's momentum stored block-wise quantized (``PrepareConfig(optimizer_state="8bit")``), or
in bf16 (``"bf16"``: ``bf16_state``).

The optimizer's own ``step`` stays (its hooks, LR schedulers' wrappers); its ``_init_group``, which
``step`` calls once per param group, is overridden on this optimizer: it steps each parameter of at
least ``optim.moments.MIN_NUMEL`` values with quantized or bf16 state (on the CPU a param group's in one call of
``optim.cpu_lists``; elsewhere ``optim.fused_adam``'s compiled graph, ``optim.adam.adam_step`` and
``optim.sgd.sgd_step`` a parameter at a time) and hands the rest (biases, norms) to the optimizer's own.
``step`` runs eagerly in a compiled training step (one graph break), as bf16-sr's does.
:func:`mixprec.export_fp32` puts fp32 moments back.

Under FSDP2 each rank steps its shard and quantizes it in blocks of its own (a block never spans
two ranks' shards), making room for the largest shard's values (FSDP2 shards dim 0, the first rank
the largest), so every rank's codes of one parameter have one length: ``optimizer.state_dict()``
hands them out as DTensors sharded on dim 0 of the mesh, which ``torch.distributed.checkpoint``
saves and loads rank by rank; a state loaded at another world size does not fit (DCP says so).
Nothing here syncs.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec._src import sharding
from mixprec._src.optim import adam, cpu_adam, cpu_lists, fused_adam, moments, sgd
from mixprec._src.step import bf16_state, kahan, own_step, sr_noise, state_checks, versions
from mixprec._src.step.host_counts import HostCounts
from mixprec._src.step.sr_noise import moved, seeds_from, shard_seed, sr_bits, stochastic_write, tensor_seed
from mixprec._src.step.state_dicts import capacity, keep_codes_on_load, sharded_codes
from mixprec._src.step.stochastic_rounding import SEED_KEY, STEP_KEY, Restore, positions, step_eagerly
from mixprec._src.step.taken_before import TakenBefore

__all__ = ["count_step", "install", "slice_block", "slice_stepper", "sliced"]


def install(
    optimizer: torch.optim.Optimizer,
    precision: str,
    handles: list[Any],
    writeback: str = "nearest",
    copies: own_step.ComputeCopies | None = None,
) -> None:
    """Make ``optimizer`` (Adam, AdamW or SGD) keep the state of its large parameters at ``precision``.

    ``writeback``: how the large bf16 parameters' weights are written, ``"nearest"`` (rounded to nearest),
    ``"stochastic"`` (level bf16-sr, installed after bf16-sr's own step: with bf16-sr's stochastic
    rounding and the noise bf16-sr would give them, the seed from the param group's counters and the
    tensor's position) or ``"kahan"`` (level bf16-kahan: with the weight's compensation); the rest go on
    through the level's own step. ``copies``: O2's compute copies, which the list kernels write with their fp32
    masters (``own_step.writes_copies``: the forward after the step copies only the rest).
    """
    state_checks.check(optimizer, precision)
    step_eagerly(optimizer, handles)
    own = optimizer.__dict__.get("_init_group")  # bf16-sr's, where it is installed
    take_rest = (lambda opt, group, *a, **k: own(group, *a, **k)) if own is not None else type(optimizer)._init_group  # type: ignore[attr-defined]
    counts = HostCounts()
    ready = TakenBefore()  # _listed's: what it found ready at a weight's last step

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if writeback == "stochastic":
            sr_noise.refuse_capture()  # before anything is counted or written
        decoupled = _decoupled(self, group)
        momentum = isinstance(self, torch.optim.SGD)
        where = positions(self) if writeback == "stochastic" or precision == moments.BF16 else {}
        rest = []
        listed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for p in group["params"]:
            if p.grad is None or p.numel() < moments.MIN_NUMEL:  # numel: the whole tensor's, on every rank
                rest.append(p)
                continue
            local_p, local_g = sharding.local(p.data), sharding.local(p.grad)
            if _listed(self, p, local_p, local_g, precision, momentum, ready):
                listed.append((p, local_p, local_g))
            elif precision == moments.BF16:
                _bf16_step(self, p, local_p, local_g, group, decoupled, momentum, writeback, where)
            elif momentum:
                write = _writeback(self, p, local_p, group, writeback, where, 0)[2]
                sgd.sgd_step(local_p, local_g, self.state[p], group, precision, capacity(p), write)
            else:
                _adam(
                    self,
                    p,
                    local_p,
                    local_g,
                    self.state[p],
                    group,
                    decoupled,
                    precision,
                    capacity(p),
                    writeback,
                    where,
                    0,
                )
        if listed:
            _step_lists(self, listed, group, decoupled, precision, writeback, where, counts, copies)
        rest_group = {**group, "params": rest}
        result = take_rest(self, rest_group, *args, **kwargs)
        if STEP_KEY in rest_group:
            group[STEP_KEY] = rest_group[STEP_KEY]  # bf16-sr's step counted on the copy it was given
        return result

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    handles.append(Restore(optimizer, "_init_group"))
    optimizer.__dict__[_INSTALLED] = (precision, writeback)
    handles.append(Restore(optimizer, _INSTALLED))
    keep_codes_on_load(optimizer, handles)  # a quantized checkpoint loads into bf16 state too
    handles.append(optimizer.register_state_dict_post_hook(sharded_codes))
    if precision == moments.BF16:
        handles.append(optimizer.register_load_state_dict_post_hook(bf16_state.narrow_after_load))


def _listed(
    optimizer: torch.optim.Optimizer,
    p: torch.Tensor,
    local_p: torch.Tensor,
    local_g: torch.Tensor,
    precision: str,
    momentum: bool,
    ready: TakenBefore,
) -> bool:
    """Whether ``p``'s step goes in its group's list (``cpu_lists``: one call for all, bitwise the per-tensor step):
    contiguous CPU weight, gradient and state the kernels take (Adam(W) at every state precision, SGD with a bf16
    buffer), its state made ready for them here. An Adam(W) weight found ready at the last step with the same state
    tensors (``ready``), dtypes and size is ready again: its checks are not made twice."""
    if not (fused_adam.NATIVE and local_p.is_contiguous() and local_g.is_contiguous()) or not local_p.is_cpu:
        return False
    state = optimizer.state[p]
    if momentum and precision != moments.BF16:  # a quantized buffer
        if not cpu_lists.sgd_quantized_builds(precision, local_p.dtype, local_g.dtype):
            return False
        return moments.is_quantized(state) or "momentum_buffer" not in state  # an fp32 one: the eager step casts it
    if momentum:
        if not cpu_adam.bf16_builds(local_p.dtype, local_g.dtype):
            return False  # the chunked step where cpu_adam's kernels are not built
        if not cpu_lists.sgd_bf16_state_builds(local_p.dtype, local_g.dtype):
            return False
        buffer = state.get(bf16_state.NAMES["sgd"][0])  # one of another dtype: the per-tensor step casts it
        held = None if buffer is None else sharding.local(buffer)
        return held is None or (held.is_contiguous() and held.is_cpu and held.dtype is torch.bfloat16)
    names = bf16_state.NAMES["adam"] if precision == moments.BF16 else _CODES
    key = (local_p.dtype, local_g.dtype, local_p.numel())
    if local_g.is_cpu and ready.same(p, key, tuple(map(state.get, names))):
        return True
    if not cpu_lists.lists_build(precision, local_p.dtype, local_g.dtype):
        return False
    if precision == moments.BF16:
        bf16_state.ready_adam(state, p)
        if not cpu_adam.bf16_available(local_p, local_g, *(sharding.local(state[n]) for n in names)):
            return False
    else:
        if not fused_adam.runs(precision, local_p, local_g):  # the eager step chosen (tests pin it against torchao's)
            return False
        adam.quantized_moments(state, p, precision, capacity(p))
        if not cpu_adam.available(precision, local_p, local_g):
            return False
    ready.note(p, key, tuple(state[n] for n in names))
    return True


#: a quantized Adam state's tensors
_CODES = ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale")


def _step_lists(
    optimizer: torch.optim.Optimizer,
    listed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    group: dict[str, Any],
    decoupled: bool,
    precision: str,
    writeback: str,
    where: dict[int, int],
    counts: HostCounts,
    copies: own_step.ComputeCopies | None = None,
) -> None:
    """One Adam(W) or SGD step of every weight of ``listed`` (``_listed``): the step counts advanced together
    (counted on the host: nothing read), then one call a list of one step count, dtypes and write rule; an fp32
    weight's O2 copy (``copies``) written with it where an eager forward reads them."""
    params = [p for p, _, _ in listed]
    states = [optimizer.state[p] for p in params]
    momentum = isinstance(optimizer, torch.optim.SGD)
    if momentum and precision == moments.BF16:
        started = [bf16_state.ready_sgd(state, p) for p, state in zip(params, states, strict=True)]
    elif momentum:
        started = [_ready_quantized_buffer(state, p, precision) for p, state in zip(params, states, strict=True)]
    lists: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    uncounted = momentum and precision != moments.BF16  # SGD's quantized buffer keeps no step count
    steps = [0.0] * len(params) if uncounted else counts.advance(params, states)
    stochastic = writeback == "stochastic"
    base, next_count = _seed_counts(group) if stochastic else (0, 0)
    moments_base = int(group[SEED_KEY]) if precision == moments.BF16 else 0  # the bf16 moments' seeds'
    copying = copies if own_step.writes_copies(copies) else None
    copied: list[torch.Tensor] = []  # the masters whose copies the kernels write
    for i, ((p, local_p, local_g), state, count) in enumerate(zip(listed, states, steps, strict=True)):
        low = local_p.dtype is torch.bfloat16
        seed = _weight_seed(base, next_count, where[id(p)], p) if low and stochastic else None
        comp = sharding.local(kahan.compensation(state, p)) if low and writeback == "kahan" else None
        copy = None if copying is None or sharding.is_sharded(p) else own_step.writable_copy(copying, p)
        mode = cpu_adam.rounding_mode(seed is not None, comp is not None, copy is not None)
        if copy is not None:  # in the compensation's column (an fp32 weight has no compensation)
            comp = copy
            copied.append(p)
        row: tuple[Any, ...]
        if momentum and precision != moments.BF16:
            row = (local_p, local_g, state, comp, 0 if seed is None else seed, started[i])
        elif momentum:
            (name,) = bf16_state.NAMES["sgd"]
            buffer_seed = bf16_state.moment_seed(moments_base, where[id(p)], p, name, int(count))
            row = (local_p, local_g, sharding.local(state[name]), comp, seed or 0, buffer_seed, started[i])
        elif precision == moments.BF16:  # the moments' seeds made by the kernel, from the position and the shard
            m, v = bf16_state.NAMES["adam"]
            row = (local_p, local_g, sharding.local(state[m]), sharding.local(state[v]), comp, seed or 0, where[id(p)])
            row += bf16_state.shard_code(p)
        else:
            row = (local_p, local_g, state, comp, 0 if seed is None else seed)
        lists.setdefault((count, local_p.dtype, local_g.dtype, mode), []).append(row)
    for (count, _, _, mode), rows in lists.items():
        if momentum and precision == moments.BF16:
            cpu_lists.sgd_bf16_state_step(rows, group, mode)
            continue
        if momentum:
            cpu_lists.sgd_quantized_step(precision, rows, group, mode)
            continue
        scalars = _scalars(group, count, decoupled)
        if precision == moments.BF16:
            m, v = bf16_state.NAMES["adam"]
            keys = (bf16_state.moment_key(moments_base, m), bf16_state.moment_key(moments_base, v))
            cpu_lists.bf16_state_step(rows, scalars, decoupled, mode, keys, int(count))
        else:
            cpu_lists.quantized_step(precision, rows, scalars, decoupled, mode)
    versions.move_as_torch(group, params)
    if copying is not None and copied:  # as their masters are now
        copying.wrote(copied)


def _scalars(group: dict[str, Any], count: float, decoupled: bool) -> torch.Tensor:
    """The list's step scalars (CPU, fp32): made on the host where the step counts are fp32 (the default dtype's)."""
    if torch.get_default_dtype() is torch.float32:
        scalars = fused_adam.host_step_scalars(group, count, decoupled)
        if scalars is not None:
            return scalars
    return fused_adam.step_scalars(group, torch.tensor(count), decoupled, torch.device("cpu"))


def _ready_quantized_buffer(state: dict[str, Any], p: torch.Tensor, precision: str) -> bool:
    """SGD's quantized momentum buffer ready for a list step (its codes and scales made where it is the first step:
    the buffer is then the gradient; no step count, as the eager step keeps none); whether the buffer had started."""
    if moments.is_quantized(state):
        moments.conform(state, precision, sharding.local(p).numel(), capacity(p))
        return True
    moments.zeros(state, "momentum_buffer", sharding.local(p).device, precision, capacity(p))
    return False


def _bf16_step(
    optimizer: torch.optim.Optimizer,
    p: torch.Tensor,
    local_p: torch.Tensor,
    local_g: torch.Tensor,
    group: dict[str, Any],
    decoupled: bool,
    momentum: bool,
    writeback: str,
    where: dict[int, int],
) -> None:
    """One step of ``p`` with its state in bf16 (``bf16_state``), its weight written as ``writeback`` says."""

    def how(offset: int, target: torch.Tensor) -> tuple[int | None, torch.Tensor | None, Any]:
        return _writeback(optimizer, p, target, group, writeback, where, offset)

    seed = bf16_state.seed_of(int(group[SEED_KEY]), where[id(p)], p)
    if momentum:
        bf16_state.sgd_step(p, local_p, local_g, optimizer.state[p], group, seed, how)
    else:
        bf16_state.adam_step(p, local_p, local_g, optimizer.state[p], group, decoupled, seed, how)


#: ``optimizer.__dict__`` key: ``(precision, writeback)`` where :func:`install` ran
_INSTALLED = "_mixprec_low_bit_state"


def _seed(group: dict[str, Any], where: dict[int, int], p: torch.Tensor, offset: int) -> int:
    """bf16-sr's seed of ``p``'s values from flat position ``offset`` of this rank's shard on."""
    return moved(_weight_seed(*_seed_counts(group), where[id(p)], p), offset)


def _seed_counts(group: dict[str, Any]) -> tuple[int, int]:
    """The group's seed and the count bf16-sr's weights are rounded with (its next: its step advances it after the
    weights are written; never inside a CUDA graph capture)."""
    sr_noise.refuse_capture()
    return int(group[SEED_KEY]), int(group[STEP_KEY]) + 1


def _weight_seed(base: int, count: int, position: int, p: torch.Tensor) -> int:
    """bf16-sr's seed of element 0 of this rank's shard of ``p`` (at ``position`` in the optimizer)."""
    return shard_seed(tensor_seed(base, count, position), p)


def _writeback(
    optimizer: torch.optim.Optimizer,
    p: torch.Tensor,
    local_p: torch.Tensor,
    group: dict[str, Any],
    writeback: str,
    where: dict[int, int],
    offset: int,
) -> tuple[int | None, torch.Tensor | None, Any]:
    """How ``local_p`` (``p``'s values from flat position ``offset`` of this rank's shard on) is written: bf16-sr's
    seed, bf16-kahan's compensation (a view of ``local_p``'s part), and the eager step's ``write`` (``None``:
    rounded to nearest; an fp32 weight always is)."""
    if local_p.dtype != torch.bfloat16:
        return None, None, None
    if writeback == "stochastic":
        seed = _seed(group, where, p, offset)
        return seed, None, stochastic_write(seed)
    if writeback == "kahan":
        comp = sharding.local(kahan.compensation(optimizer.state[p], p)).view(-1)[offset : offset + local_p.numel()]
        comp = comp.view(local_p.shape)
        return None, comp, functools.partial(kahan.write, comp=comp)
    return None, None, None


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay is AdamW's (decoupled) rather than Adam's (L2)."""
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _adam(
    optimizer: torch.optim.Optimizer,
    p: torch.Tensor,
    local_p: torch.Tensor,
    local_g: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    decoupled: bool,
    precision: str,
    capacity: int,
    writeback: str,
    where: dict[int, int],
    offset: int,
) -> None:
    """One quantized Adam(W) step of ``local_p`` (``p``'s local values, or those from flat position ``offset``
    on) with the moments in ``state``, its weight written as ``writeback`` says."""
    seed, comp, write = _writeback(optimizer, p, local_p, group, writeback, where, offset)
    if local_p.is_contiguous() and local_g.is_contiguous() and fused_adam.runs(precision, local_p, local_g):
        rounding, seed_at = (None, None) if seed is None else (sr_bits, seeds_from(seed, local_p.device))
        fused_adam.adam_step(local_p, local_g, state, group, decoupled, precision, capacity, rounding, seed_at, comp)
    else:
        adam.adam_step(local_p, local_g, state, group, decoupled, precision, capacity, write)


def sliced(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """The block size :func:`slice_stepper` steps ``p`` in multiples of, or 0 where it cannot (``optimizer``'s
    state is not quantized here, or :func:`slice_block` says no)."""
    installed = optimizer.__dict__.get(_INSTALLED)
    return 0 if installed is None else slice_block(installed[0], optimizer, p)


def slice_block(precision: str, optimizer: torch.optim.Optimizer | None, p: torch.Tensor) -> int:
    """The block size a step of ``p`` with ``precision`` state could be taken a slice at a time in multiples of,
    or 0: ``optimizer`` an Adam or AdamW, ``p`` whole (not sharded) and large enough to be quantized."""
    if precision not in moments.FORMATS or not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return 0
    if sharding.is_sharded(p) or p.numel() < moments.MIN_NUMEL:
        return 0
    return moments.FORMATS[precision][1]


@torch.no_grad()
def slice_stepper(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict[str, Any]) -> Callable[..., None]:
    """``step(grad, first)``: Adam(W)'s step of ``p``'s flat values ``first`` to ``first + grad.numel()``
    (``grad``: their gradient) as the step of the whole ``p`` steps them: their blocks of the moments, the
    step count the whole step counts (``state["step"]`` is not advanced: :func:`count_step` does that once,
    after the last slice), bf16-sr's noise of each value's position in ``p``, bf16-kahan's compensation.
    ``first`` is a multiple of the block size (:func:`sliced`), and so is the slice's length unless it ends
    ``p``. What every slice shares (the scalars, the seed, the state's views) is made once. Nothing syncs."""
    precision, writeback = optimizer.__dict__[_INSTALLED]
    bits, block = moments.FORMATS[precision]
    state = optimizer.state[p]
    adam.quantized_moments(state, p, precision, p.numel())
    decoupled = _decoupled(optimizer, group)
    where = positions(optimizer) if writeback == "stochastic" else {}
    flat = p.data.view(-1)

    def views(first: int, n: int) -> tuple[dict[str, torch.Tensor], int]:
        last = first + n == p.numel()
        view = {}
        for name in ("exp_avg", "exp_avg_sq"):
            codes, scale = state[f"{name}_codes"], state[f"{name}_scale"]
            end = None if last else (first + n) // block
            view[f"{name}_scale"] = scale[first // block : end]
            view[f"{name}_codes"] = codes[first * bits // 8 : None if end is None else end * block * bits // 8]
        return view, (view["exp_avg_scale"].numel() * block if last else n)

    if not (fused_adam.NATIVE and p.is_contiguous() and cpu_adam.available(precision, flat[:1], flat[:1])):

        def general(grad: torch.Tensor, first: int) -> None:  # the step each parameter takes, on views
            view, capacity = views(first, grad.numel())
            view["step"] = state["step"].clone()
            _adam(
                optimizer,
                p,
                flat[first : first + grad.numel()],
                grad.reshape(-1),
                view,
                group,
                decoupled,
                precision,
                capacity,
                writeback,
                where,
                first,
            )

        return general
    scalars = fused_adam.step_scalars(group, state["step"] + 1, decoupled, p.device)
    seed, comp, _ = _writeback(optimizer, p, flat, group, writeback, where, 0)  # comp: the whole weight's, flat
    mode = cpu_adam.rounding_mode(stochastic=seed is not None, compensated=comp is not None)

    def native(grad: torch.Tensor, first: int) -> None:  # on the CPU: the block kernel on the slice's views
        n = grad.numel()
        view, _ = views(first, n)
        cpu_adam.adam_step(
            flat[first : first + n],
            grad.reshape(-1),
            view,
            scalars,
            decoupled,
            precision,
            mode,
            0 if seed is None else moved(seed, first),
            None if comp is None else comp[first : first + n],
        )

    return native


def count_step(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """Count the step :func:`slice_stepper` took of ``p`` a slice at a time."""
    optimizer.state[p]["step"] += 1
