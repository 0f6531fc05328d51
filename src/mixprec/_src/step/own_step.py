"""The optimizer's own step (torch's Adam(W) and SGD) of what the other stages leave, in one call a param group on
the CPU: :func:`install`.

What the levels leave to the optimizer's own step (every weight at O1 and O2's fp32 masters, bf16-pure's bf16
weights, the norms kept in fp32 at the bf16 levels, whatever a state precision leaves) torch's for-loop and foreach
Adam(W) and SGD step with several ATen ops a weight on the CPU: their step grows with the model. Here those weights
(fp32; and bf16 ones with Adam(W), but for Adam's L2 decay) take one call of
``optim.aten_lists`` a param group (and step count) instead, bit for bit torch's step (the kernels compute each
op as ATen does, MKL's square root included; a probe checks them where they run, and where they do not match,
torch's own step runs). Installed outermost on the optimizer's ``_init_group``: whatever the other stages handed
on to torch's step (the lists ``_init_group`` fills) is taken from the lists, stepped, counted (Adam's step
counts; SGD's new momentum buffers put in its state, as its step puts them), and torch's step gets what is left.
Adam(W)'s fused form (``fused=True``) on fp32 and bf16 weights takes ``optim.fused_lists`` the same way: one call a
param group (and dtype) for what torch runs one kernel a tensor for, bit for bit torch's fused kernel, and O2's bf16
copies of fp32 weights written in the same pass (``prepare.o2_copies.ComputeCopies.wrote``: the forward after the
step copies only the rest), as SGD's one call writes its fp32 weights' copies (told after the versions move). SGD's
fused form stays torch's. A param group whose lists hold the same tensors as at
its last step (the usual step) is not checked tensor by tensor again: its tables are kept, the new gradients'
addresses written in. The weights' version counters move as torch's for-loop and foreach in-place ops move them (a
write between a forward and its backward is reported by autograd), not with the fused form (torch's fused kernel
does not move them: O2's aliases of the masters then live across steps). Nothing here syncs: step counts are counted
on the host.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from mixprec._src.optim import aten_lists, cpu_lists, fused_lists
from mixprec._src.step import host_counts, versions
from mixprec._src.step.host_counts import HostCounts
from mixprec._src.step.stochastic_rounding import Restore

__all__ = ["install", "takes_group", "writable_copy", "writes_copies"]

_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


class ComputeCopies(Protocol):
    """What the step reads of O2's compute copies (``prepare.o2_copies.ComputeCopies``)."""

    dtype: torch.dtype
    copies: dict[int, torch.Tensor]  # id(master) -> its copy
    read: bool  # an eager forward read them since the last step (a compiled one does not: none written then)

    def wrote(self, params: list[torch.Tensor]) -> None: ...


def takes_group(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether torch steps ``group`` with arithmetic the kernels have: Adam(W)'s or SGD's for-loop or foreach form
    (not capturable, differentiable or amsgrad), or Adam(W)'s fused one (``fused_lists.supports``)."""
    if type(optimizer) in _ADAMS and group.get("fused"):
        return fused_lists.supports(optimizer, group)
    if type(optimizer) not in (*_ADAMS, torch.optim.SGD):
        return False
    return not (group.get("fused") or group.get("capturable") or group.get("differentiable") or group.get("amsgrad"))


def install(optimizer: torch.optim.Optimizer, handles: list[Any], copies: ComputeCopies | None = None) -> None:
    """Step the CPU weights torch's Adam(W) or SGD would step one by one in one call a param group (see the
    module); ``copies``: O2's compute copies, which the fused form writes with their masters."""
    if not any(p.is_cpu for g in optimizer.param_groups for p in g["params"]):
        return
    if type(optimizer) in _ADAMS:
        take: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]] = _AdamLists(copies)
    elif type(optimizer) is torch.optim.SGD:
        take = functools.partial(_sgd_lists, copies=copies)
    else:
        return
    inner = optimizer.__dict__.get("_init_group")  # another stage's (a method of this optimizer), or the class's own
    collect = inner.__func__ if inner is not None else type(optimizer)._init_group  # type: ignore[attr-defined]

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *lists: list[Any]) -> Any:
        found = collect(self, group, *lists)
        if lists[0] and takes_group(self, group) and not torch.compiler.is_compiling():
            stepped, copied = take(self, group, *lists)
            versions.move_as_torch(group, stepped)
            if copied and copies is not None:  # the copies the step wrote, as their masters are now
                copies.wrote(copied)
        return found

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    handles.append(Restore(optimizer, "_init_group"))  # as every stage's: the class's own back


def _keep(lists: tuple[list[Any], ...], left: list[int]) -> None:
    for held in lists:  # torch's step gets the rest
        held[:] = [held[i] for i in left]


class _Taken:
    """What the own step took of a param group at its last step: the lists' items (compared by identity at the next
    step), which it took and left, their tables (a dtype each; the gradients' column rewritten at each step), the
    O2 copies the tables write, and the step counts as the tensors hold them."""

    __slots__ = (
        "copies",
        "counts",
        "left",
        "lists",
        "ptrs",
        "stepped",
        "tables",
        "taken",
        "versions",
        "wants",
        "wrote",
    )

    def __init__(self, lists: tuple[list[torch.Tensor], ...], taken: list[int], left: list[int]) -> None:
        self.lists = tuple(list(held) for held in lists)  # params, exp_avgs, exp_avg_sqs, state_steps
        self.taken, self.left = taken, left
        self.stepped = [lists[0][i] for i in taken]  # the weights it steps
        self.ptrs = _addresses(lists, taken)
        self.tables: list[tuple[torch.dtype, list[int], cpu_lists.Table]] = []  # (dtype, places in taken, table)
        self.counts = 0.0
        self.versions: list[int] = []
        self.wrote: list[torch.Tensor] = []  # the masters whose O2 copies the tables write
        self.copies: list[torch.Tensor] = []  # and those copies
        self.wants = False  # whether the step wrote the copies (an eager forward read them)

    def holds(self, lists: tuple[list[torch.Tensor], ...], grads: list[torch.Tensor], copies: Any) -> bool:
        """Whether this step's lists hold the same tensors as the last one's (at the same addresses; step counts not
        written since; the same O2 copies) and the gradients of the weights taken go in a table as they are
        (contiguous, none a subclass: autograd and the ``.grad`` setter hold a gradient to its weight's dtype,
        size and device)."""
        for held, now in zip(self.lists, lists, strict=True):
            if len(held) != len(now) or not all(map(operator.is_, held, now)):
                return False
        for i in self.taken:  # a loop, not all() over a generator: this runs at every step
            g = grads[i]
            if type(g) is not torch.Tensor or not g.is_contiguous():
                return False
        if self.wants != writes_copies(copies):
            return False
        if self.wrote and not all(map(operator.is_, [copies.copies.get(id(p)) for p in self.wrote], self.copies)):
            return False
        steps = lists[3]
        return _addresses(lists, self.taken) == self.ptrs and [steps[i]._version for i in self.taken] == self.versions


def writes_copies(copies: ComputeCopies | None) -> bool:
    """Whether a step's kernels write O2's copies with their masters: bf16 ones an eager forward read since the last
    step (a compiled forward casts the masters in its graph)."""
    return copies is not None and copies.dtype is torch.bfloat16 and copies.read


def writable_copy(copies: ComputeCopies, p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s O2 compute copy where a kernel can write it with ``p`` (an fp32 weight; a contiguous copy of its
    size), else ``None``."""
    c = copies.copies.get(id(p))
    if c is not None and p.dtype is torch.float32 and c.shape == p.shape and c.is_contiguous():
        return c
    return None


def _addresses(lists: tuple[list[torch.Tensor], ...], taken: list[int]) -> list[int]:
    params, exp_avgs, exp_avg_sqs = lists[0], lists[1], lists[2]
    return [t.data_ptr() for i in taken for t in (params[i], exp_avgs[i], exp_avg_sqs[i])]


class _AdamLists:
    """Takes Adam(W)'s fp32 and bf16 weights out of the lists ``_init_group`` filled and steps them, a dtype and step
    count at a time. A param group whose lists hold the same tensors as at its last step (the usual step) is not
    checked tensor by tensor again: its tables are kept, and only the gradients' addresses written into them."""

    def __init__(self, copies: ComputeCopies | None = None) -> None:
        self.counts = HostCounts()
        self.copies = copies
        self.last: dict[int, _Taken] = {}  # id(param group) -> what its last step took

    def __call__(
        self, opt: torch.optim.Optimizer, group: dict[str, Any], *lists: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step what the kernels take of ``lists`` (taken out of them); the weights stepped, and none whose copies it
        leaves to be told (the fused kernel's are told as it writes them: it moves no version)."""
        params, grads, exp_avgs, exp_avg_sqs, _, state_steps = lists
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
        fused = bool(group.get("fused"))
        held = (params, exp_avgs, exp_avg_sqs, state_steps)
        if self.last and (id(group) not in self.last or len(self.last) > len(opt.param_groups)):
            current = {id(g) for g in opt.param_groups}  # the step in backward steps copies of the groups: only
            self.last = {k: v for k, v in self.last.items() if k in current}  # the optimizer's groups' are kept
        last = self.last.pop(id(group), None)
        if last is not None and last.holds(held, grads, self.copies) and self._again(last, group, grads, decoupled):
            self.last[id(group)] = last
            _keep((params, grads, exp_avgs, exp_avg_sqs, state_steps), last.left)
            return last.stepped, []
        taken: list[int] = []
        left: list[int] = []
        for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True)):
            dtype = p.dtype
            mine = (
                aten_lists.takes(p, g, m, v, dtype=dtype)
                and t.dtype is torch.float32
                and t.is_cpu
                and t.dim() == 0
                and (
                    fused_lists.available(dtype)
                    if fused
                    else aten_lists.supports(group, dtype, decoupled) and aten_lists.available(dtype)
                )
            )
            (taken if mine else left).append(i)
        if not taken:
            return [], []
        chosen = [params[i] for i in taken]
        counts = self.counts.advance(chosen, [opt.state[p] for p in chosen])
        by_kind: dict[tuple[torch.dtype, float], list[int]] = {}
        for place, (i, count) in enumerate(zip(taken, counts, strict=True)):
            by_kind.setdefault((params[i].dtype, count), []).append(place)
        plan = _Taken(held, taken, left) if len(set(counts)) == 1 and counts[0] < host_counts.EXACT - 1 else None
        if plan is not None:
            plan.wants = writes_copies(self.copies)
        with torch.no_grad():
            for (dtype, count), places in by_kind.items():
                rows = [(params[taken[k]], grads[taken[k]], exp_avgs[taken[k]], exp_avg_sqs[taken[k]]) for k in places]
                if fused:
                    with_copies = self._with_copies(rows)
                    table = fused_lists.table(with_copies)
                    fused_lists.step_table(table, dtype, group, count, decoupled)
                    if plan is not None:
                        plan.wrote += [row[0] for row in with_copies if row[4] is not None]
                        plan.copies += [row[4] for row in with_copies if row[4] is not None]
                else:
                    table = aten_lists.table(rows)
                    aten_lists.step_table(table, dtype, group, count, decoupled)
                if plan is not None:
                    plan.tables.append((dtype, places, table))
        if plan is not None:  # the next step of the same tensors counts on the host, one added to each
            plan.counts, plan.versions = counts[0], [state_steps[i]._version for i in taken]
            self.last[id(group)] = plan
        _keep((params, grads, exp_avgs, exp_avg_sqs, state_steps), left)
        return chosen, []

    def _again(self, last: _Taken, group: dict[str, Any], grads: list[torch.Tensor], decoupled: bool) -> bool:
        """Step a param group's weights as at its last step (its tables, the new gradients' addresses written in),
        every count one more; whether it did (not where the counts would pass what fp32 counts exactly, nor where
        the group's options are no longer the kernel's)."""
        now = last.counts + 1.0
        fused = bool(group.get("fused"))
        if now >= host_counts.EXACT:
            return False
        if not fused and not all(aten_lists.supports(group, d, decoupled) for d, _, _ in last.tables):
            return False
        steps = [last.lists[3][i] for i in last.taken]
        host_counts.write(steps, [now] * len(steps))
        last.counts, last.versions = now, [t._version for t in steps]
        taken = last.taken
        with torch.no_grad():
            for dtype, places, table in last.tables:
                table.set_column(aten_lists.GRADS, [grads[taken[k]].data_ptr() for k in places])
                if fused:
                    fused_lists.step_table(table, dtype, group, now, decoupled)
                else:
                    aten_lists.step_table(table, dtype, group, now, decoupled)
        if last.wrote and self.copies is not None:
            self.copies.wrote(last.wrote)
        return True

    def _with_copies(self, rows: Sequence[tuple[torch.Tensor, ...]]) -> list[Any]:
        """``rows`` with each weight's O2 compute copy where it has a bf16 one of its size the kernel can write
        (told to the copies: the forward after the step does not copy it again), else ``None``; none where no eager
        forward read the copies since the last step (a compiled model's: its graph casts the masters)."""
        copies = self.copies
        if copies is None or not writes_copies(copies):
            return [(*row, None) for row in rows]
        out, wrote = [], []
        for row in rows:
            c = writable_copy(copies, row[0])
            if c is not None:
                wrote.append(row[0])
            out.append((*row, c))
        copies.wrote(wrote)
        return out


def _sgd_lists(
    opt: torch.optim.Optimizer, group: dict[str, Any], *lists: list[Any], copies: ComputeCopies | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Takes SGD's fp32 and bf16 weights out of the lists ``_init_group`` filled and steps them, a dtype at a time; a
    momentum buffer made at a weight's first step goes in its state, as SGD's step puts it there; an fp32 weight's O2
    copy (``copies``) written with it where an eager forward reads them. The weights stepped, and those whose copies
    were written (to be told after their versions move)."""
    params, grads, buffers = lists
    momentum = float(group["momentum"]) != 0
    taken: dict[torch.dtype, list[int]] = {torch.float32: [], torch.bfloat16: []}
    left: list[int] = []
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        buffer = buffers[i] if momentum else None
        dtype = p.dtype
        mine = (
            dtype in taken
            and aten_lists.takes(p, g, *([] if buffer is None else [buffer]), dtype=dtype)
            and (aten_lists.sgd_available() if dtype is torch.float32 else aten_lists.sgd_bf16_available())
        )
        (taken[dtype] if mine else left).append(i)
    if not (taken[torch.float32] or taken[torch.bfloat16]):
        return [], []
    # torch's foreach form multiplies its bf16 buffers by a bf16 momentum where all of them were started
    all_started = not momentum or all(
        b is not None for p, b in zip(params, buffers, strict=True) if p.dtype is torch.bfloat16
    )
    copied: list[torch.Tensor] = []
    with torch.no_grad():
        for dtype, places in taken.items():
            rows = []
            for i in places:
                p, buffer = params[i], buffers[i] if momentum else None
                started = buffer is not None
                if momentum and buffer is None:
                    made = torch.empty_like(p, memory_format=torch.contiguous_format)
                    buffer = opt.state[p]["momentum_buffer"] = made
                rows.append((p, grads[i], buffer, started))
            if rows and dtype is torch.float32:
                copied += _sgd_fp32(rows, group, copies)
            elif rows:
                aten_lists.sgd_bf16_step(rows, group, all_started)
    stepped = [params[i] for places in taken.values() for i in places]
    _keep((params, grads, *([buffers] if momentum else [])), left)
    return stepped, copied


def _sgd_fp32(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]],
    group: dict[str, Any],
    copies: ComputeCopies | None,
) -> list[torch.Tensor]:
    """SGD's step of fp32 ``rows`` in one call, each weight's O2 copy written with it where the kernel can write it;
    the weights whose copies it wrote."""
    if copies is None or not writes_copies(copies):
        aten_lists.sgd_step(rows, group)
        return []
    found = [writable_copy(copies, row[0]) for row in rows]
    written = [row[0] for row, c in zip(rows, found, strict=True) if c is not None]
    aten_lists.sgd_step(rows, group, found if written else None)
    return written
