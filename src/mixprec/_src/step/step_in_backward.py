"""Each parameter stepped as soon as its gradient is ready, and the gradient freed: ``step_in_backward=True``.

Gradients then never occupy memory for the whole model at once (torch's
``register_post_accumulate_grad_hook`` pattern; LOMO). The training loop is unchanged:
``loss.backward()`` steps each parameter the moment its gradient is whole (a hook on the parameter; under
FSDP2, on each unit's parameters right after their gradients are reduce-scattered) and sets its ``.grad``
to ``None``; ``optimizer.step()`` then finishes the step: the optimizer's step hooks (O2's compute copies,
fp8's scales, bf16-sr's counters, the user's own) and LR schedulers run there, once. Each parameter is
stepped by the optimizer's own code, in a param group of its own holding the group's hyperparameters,
so the numbers are the plain step's, bit for bit. Where the optimizer keeps Adam(W)'s moments quantized, a
large GEMM weight's gradient is made and stepped a slice of rows at a time inside its layer's backward
(``sliced_gradients``), so not even one whole gradient of it is alive.

On one process without clipping, whole gradients wait in a bucket until they add up to :data:`BUCKET` bytes, then
step together, one call of the optimizer's step for the bucket (with a call a weight, the bench's tiny transformer
trained at 0.84x the plain step's speed); what the bucket holds at ``optimizer.step()`` steps with that step's own
walk of the stages (its gradients freed after it). A gradient larger than the bucket fills it alone and steps as it
comes: fewer than :data:`BUCKET` bytes wait beside the gradient being made.
Clipping, or under FSDP2, each large parameter steps as its gradient comes, and the small parameters (fewer than
:data:`SMALL` values: biases, norms; their state is never quantized) are counted into the norm as their gradients
come (without clipping, at ``optimizer.step()``, in one call) and stepped together at ``optimizer.step()``, before
its own step: one call of the optimizer's step for all of them, their gradients (a few kilobytes a layer) kept until
then.

Clipping (``clip_grad_norm``): a global norm needs every gradient, and a gradient is gone once its
parameter is stepped. Each gradient is scaled by ``min(1, max_norm / max(previous, so_far))``: the
previous step's global norm, or the norm of the gradients seen so far in this backward where that is
larger (a spike is clipped from the gradient that shows it on); the small parameters by ``so_far`` of
the whole backward. The first step has only ``so_far``. Not clipping, the norm is still measured
(``grad_norm``): each gradient's squared norm taken as it comes, all summed once at ``optimizer.step()``.
Under FSDP2 ``so_far`` is summed over ranks (one scalar all-reduce per unit), so every rank scales alike.
``previous`` is saved in ``optimizer.state_dict()`` (param-group key ``"mixprec_grad_norm"``, read from the
device only then), so a resumed run clips as an uninterrupted one.

Refused: gradient accumulation over several backwards (each backward steps: a parameter's second
gradient before ``optimizer.step()`` raises), DDP and other multi-rank setups without FSDP2 (the hook would
step a rank's own gradient, before DDP averages it), and fp16 with a ``GradScaler``: skipping a step on
inf/NaN needs every gradient checked before any parameter moves (prepare refuses fp16 here; bf16 needs no
loss scaling). Syncs: none on one process; under FSDP2 the per-unit all-reduce of one scalar.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from mixprec._src import sharding
from mixprec._src.optim import moments
from mixprec._src.step.grad_norms import NORM_CHUNK, square_norm, square_norms
from mixprec._src.step.stochastic_rounding import finisher, fixed_positions, positions

__all__ = [
    "KEY",
    "NORM_CHUNK",
    "NORM_GROUP_KEY",
    "SMALL",
    "Stepper",
    "check",
    "clip_before_step",
    "grad_norm",
    "install",
    "square_norm",
    "square_norms",
]

#: bytes of whole gradients held to be stepped together (one process, not clipping): a bucket, as DDP's first one
BUCKET = 1 << 20
#: ``optimizer.__dict__`` key of the :class:`Stepper` (also read by the GradScaler, which refuses it)
KEY = "_mixprec_step_in_backward"
_NORM_KEY = "_mixprec_grad_norm"  # the last step's norm where prepare clips after backward
_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
#: param-group key of the previous step's global norm in a state dict (where clipping in backward)
NORM_GROUP_KEY = "mixprec_grad_norm"


def check(optimizer: torch.optim.Optimizer) -> None:
    """Raise where ``optimizer`` cannot be stepped one parameter at a time (fp16 is refused by the config)."""
    kind = type(optimizer)
    if not kind.__module__.startswith("torch.optim") or kind in (torch.optim.LBFGS, torch.optim.SparseAdam):
        raise ValueError(
            f"step_in_backward=True steps one parameter at a time with the optimizer's own code, which "
            f"holds for torch.optim's per-parameter optimizers (not LBFGS or SparseAdam); this one is a "
            f"{kind.__name__}: use step_in_backward=False"
        )


class Stepper:
    """Steps ``optimizer``'s parameters one at a time as their gradients become whole; see the module."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float | None, group: Any = None) -> None:
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.process_group = group  # FSDP2's: so_far and the norm are summed over it
        self.stepped: set[int] = set()
        self.so_far: torch.Tensor | None = None  # sum of squares of this backward's gradients
        self.previous: torch.Tensor | None = None  # the last step's global norm
        self.groups: dict[int, dict[str, Any]] | None = None  # id(param) -> its param group, this round
        self.positions: dict[int, int] | None = None  # id(param) -> its position in the optimizer, this round
        self.waiting: list[torch.Tensor] = []  # small parameters counted into the norm, stepped at step()
        self.squares: list[torch.Tensor] = []  # squared norms (0-dim, or 1-D for several) not yet in so_far
        self.raw_step = _unhooked_step(optimizer)
        # whole gradients held to be stepped together (BUCKET): one process, not clipping (each gradient's clipping
        # scale is the norm up to it)
        self.bucket = BUCKET if max_norm is None and group is None else 0
        self.held: list[torch.Tensor] = []  # the parameters whose gradients wait in the bucket, in the order they came
        self.held_bytes = 0
        self.stepping: list[torch.Tensor] = []  # what the bucket held at optimizer.step(): its own step steps them
        self.small_squares: list[torch.Tensor] = []  # the small parameters' squared norms, summed after the others'

    def _round(self) -> dict[int, dict[str, Any]]:
        if self.groups is None:
            self.groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
            self.positions = positions(self.optimizer)  # the seeds' positions: made once a round, not once a step
        return self.groups

    def hold(self, p: torch.Tensor) -> None:
        """Hold ``p``'s whole gradient in the bucket (it counts as stepped: a second gradient raises); the bucket is
        stepped once it holds :attr:`bucket` bytes, and what it holds at ``optimizer.step()`` by that step."""
        grad = p.grad
        if grad is None or id(p) not in self._round():
            return
        self.begin(p)
        self.stepped.add(id(p))
        self.held.append(p)
        self.held_bytes += grad.nbytes
        if self.held_bytes >= self.bucket:
            self.flush()

    def flush(self) -> None:
        """Step the gradients held in the bucket together (:meth:`hold`), and free them."""
        held = self._take_held()
        if held:
            self._step_now(held, None)

    def _take_held(self) -> list[torch.Tensor]:
        """The parameters the bucket holds (with a gradient), the bucket emptied; their squared norms held in the
        order they came, the small parameters' apart: summed after the others', as where they wait for the step."""
        held = [p for p in self.held if p.grad is not None]
        self.held, self.held_bytes = [], 0
        large = [p.grad for p in held if p.numel() >= SMALL]
        small = [p.grad for p in held if p.numel() < SMALL]
        if held:  # one call for both, the large ones' norms first (a 1-D tensor, whatever the bucket holds)
            norms = square_norms([sharding.local(g) for g in large + small])  # type: ignore[arg-type]
            self.squares.append(norms[: len(large)])
            self.small_squares.append(norms[len(large) :])
        return held

    def add_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Count ``grads`` (local shards) into this backward's norm; the scale of the clipping (or ``None``). Not
        clipping on one process, their squares are only held, and summed once, at :meth:`finish`. The bucket is
        stepped first: the squares are summed in the order the gradients came."""
        self.flush()
        return self._add_norm(grads)

    @staticmethod
    def _norms(grads: list[torch.Tensor]) -> torch.Tensor:
        """The squared norms of ``grads``' local shards: one, a 0-dim tensor; several, a 1-D one, made in one call."""
        if len(grads) == 1:
            return square_norm(sharding.local(grads[0]))
        return square_norms([sharding.local(g) for g in grads])

    def _add_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        one = len(grads) == 1
        norms = self._norms(grads)
        if self.max_norm is None and self.process_group is None:
            self.squares.append(norms)
            return None
        sq = norms if one else norms.sum()
        if self.process_group is not None:
            torch.distributed.all_reduce(sq, group=self.process_group)
        self.so_far = sq if self.so_far is None else self.so_far + sq
        return self._scale()

    def _scale(self) -> torch.Tensor | None:
        if self.max_norm is None or self.so_far is None:
            return None
        bound = self.so_far.sqrt()
        if self.previous is not None:
            bound = torch.maximum(bound, self.previous)
        return torch.clamp(self.max_norm / (bound + _EPS), max=1.0)

    def step(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` (their gradients whole) and free their gradients."""
        groups = self._round()
        params = [p for p in params if p.grad is not None and id(p) in groups]
        if not params:
            return
        for p in params:
            self.begin(p)
        self._step_now(params, self.add_norm([p.grad for p in params]))  # type: ignore[misc]

    def count(self, p: torch.Tensor) -> None:
        """Hold a small parameter's gradient (whole) for :meth:`step_waiting`; where clipping, count it into the norm
        now (the norm so far that scales the gradients after it)."""
        if p.grad is not None and id(p) in self._round():
            self.begin(p)
            if self.max_norm is not None:
                self.add_norm([p.grad])
            self.stepped.add(id(p))
            self.waiting.append(p)

    def step_waiting(self, *_: Any) -> None:
        """At ``optimizer.step()``: what the bucket holds is counted into the norm and left to the optimizer's own
        step, which comes next; the small parameters held where clipping (or under FSDP2) step together, clipped by the
        whole step's norm (not clipping: their gradients counted into the norm here, in one call)."""
        # what the bucket holds steps with the optimizer's own step, which comes next (one walk of the stages, not two)
        self.stepping = self._take_held()
        waiting = [p for p in self.waiting if p.grad is not None]
        self.waiting = []
        if waiting:
            if self.max_norm is None:
                self.add_norm([p.grad for p in waiting])  # type: ignore[misc]
            self._step_now(waiting, self._scale())

    def _step_now(self, params: list[torch.Tensor], scale: torch.Tensor | None) -> None:
        with torch.no_grad(), fixed_positions(self.optimizer, self.positions):
            if scale is not None:
                for p in params:
                    p.grad.mul_(scale.to(p.grad.device))  # type: ignore[union-attr]
            self._step_these(params)
            for p in params:
                p.grad = None
                self.stepped.add(id(p))

    def begin(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s param group, to step it now (raises where ``p`` was stepped already this round)."""
        if id(p) in self.stepped:
            raise RuntimeError(
                "a parameter got a second gradient before optimizer.step(): with "
                "step_in_backward=True every backward steps the parameters, so gradients cannot "
                "be accumulated over several backwards. Call optimizer.step() after each "
                "backward (it finishes the step), or prepare with step_in_backward=False to "
                "accumulate"
            )
        return self._round()[id(p)]

    def _step_these(self, params: list[torch.Tensor]) -> None:
        """One call of the optimizer's step over ``params`` alone, each in (a copy of) its own param group."""
        own, groups = self.optimizer.param_groups, self._round()
        mine: dict[int, list[torch.Tensor]] = {}
        for p in params:
            mine.setdefault(id(groups[id(p)]), []).append(p)
        self.optimizer.param_groups = [{**g, "params": mine[id(g)]} for g in own if id(g) in mine]
        try:
            self.raw_step(self.optimizer)
            finish = finisher(self.optimizer)  # bf16-sr's generic path writes its fp32 copies back
            if finish is not None:
                finish(self.optimizer)
        finally:
            self.optimizer.param_groups = own

    def finish(self, *_: Any) -> None:
        """After ``optimizer.step()``: this step's norm is the next one's ``previous``; a new round starts."""
        for p in self.stepping:  # stepped by the optimizer's own step: their gradients freed, as the bucket's are
            p.grad = None
        self.stepping = []
        self.squares += self.small_squares
        self.small_squares = []
        if self.squares:  # 0-dim and 1-D ones in the order they came, one op: the sum of their stack
            held = torch.hstack(self.squares).sum()
            self.so_far = held if self.so_far is None else self.so_far + held
            self.squares = []
        if self.so_far is not None:
            self.previous = self.so_far.sqrt()
            self.optimizer.__dict__[_NORM_KEY] = self.previous
        self.so_far, self.groups, self.positions = None, None, None
        self.stepped.clear()


#: parameters with fewer values (biases, norms: their optimizer state is never quantized) have their gradients
#: counted into the norm as they come, and kept until ``optimizer.step()``, which steps them all in one call of
#: the optimizer's step, before its own
SMALL = moments.MIN_NUMEL


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer class's ``step`` without the wrapper that runs step hooks (they run once, at ``step()``)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def install(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float | None,
    handles: list[Any],
    slices: bool = True,
) -> Stepper:
    """Step ``optimizer``'s parameters in ``model``'s backward (see the module); ``slices``: large weights'
    gradients a slice at a time where ``sliced_gradients`` takes them (not in O2: its layers compute with
    copies of the parameters the optimizer steps)."""
    group = sharding.process_group(model)
    stepper = Stepper(optimizer, max_norm, group)
    in_units: set[int] = set()
    for unit in sharding.fsdp_units(model):
        in_units.update(id(fp.sharded_param) for fp in unit.fsdp_params)
        _after_reduce_scatter(unit, stepper, handles)
    hooked = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in in_units and p.requires_grad]
    for param in hooked:
        then = _hold_param if stepper.bucket else _step_param if param.numel() >= SMALL else _count_param
        handles.append(param.register_post_accumulate_grad_hook(functools.partial(then, stepper)))
    if stepper.bucket or any(p.numel() < SMALL for p in hooked):  # before the optimizer's own step, as the
        handles.append(optimizer.register_step_pre_hook(stepper.step_waiting))  # backward's steps are
    handles.append(optimizer.register_step_post_hook(stepper.finish))
    if slices and group is None:  # FSDP2 reduce-scatters whole gradients: its weights are stepped whole
        from mixprec._src.step import sliced_gradients  # it imports the optimizer-state step, which imports this

        sliced_gradients.install(model, optimizer, stepper, handles)
    if max_norm is not None:
        _save_previous(optimizer, stepper, handles)
    optimizer.__dict__[KEY] = stepper
    handles.append(_Drop(optimizer, KEY))
    return stepper


def _save_previous(optimizer: torch.optim.Optimizer, stepper: Stepper, handles: list[Any]) -> None:
    """The previous step's norm into the state dict's param groups (one read from the device) and back on load."""

    def save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        norm = -1.0 if stepper.previous is None else float(stepper.previous)
        return {**state_dict, "param_groups": [{**g, NORM_GROUP_KEY: norm} for g in state_dict["param_groups"]]}

    def load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        groups = state_dict["param_groups"]
        norms = [g[NORM_GROUP_KEY] for g in groups if NORM_GROUP_KEY in g]
        if norms:
            norm = float(norms[0])
            stepper.previous = None if norm < 0 else torch.tensor(norm, dtype=torch.float32)
        return {**state_dict, "param_groups": [{k: v for k, v in g.items() if k != NORM_GROUP_KEY} for g in groups]}

    handles.append(optimizer.register_state_dict_post_hook(save))
    handles.append(optimizer.register_load_state_dict_pre_hook(load))  # type: ignore[arg-type]


def _step_param(stepper: Stepper, param: torch.Tensor) -> None:
    _refuse_unsharded_ranks(stepper)
    stepper.step([param])


def _hold_param(stepper: Stepper, param: torch.Tensor) -> None:
    if stepper.groups is None:  # a round's first gradient (ranks do not change within a backward)
        _refuse_unsharded_ranks(stepper)
    stepper.hold(param)


def _count_param(stepper: Stepper, param: torch.Tensor) -> None:
    _refuse_unsharded_ranks(stepper)
    stepper.count(param)


def _refuse_unsharded_ranks(stepper: Stepper) -> None:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and stepper.process_group is None and torch.distributed.get_world_size() > 1:
        raise RuntimeError(
            "step_in_backward=True steps each parameter on this rank's gradient as soon as it is "
            "ready, before DDP (or any data parallelism outside FSDP2) averages it over ranks; shard "
            "the model with FSDP2 (fully_shard), or prepare with step_in_backward=False"
        )


def _after_reduce_scatter(unit: Any, stepper: Stepper, handles: list[Any]) -> None:
    """Step ``unit``'s parameters right after FSDP2 reduce-scatters their gradients."""
    own = unit.post_backward

    def post_backward(self: Any, *args: Any) -> Any:
        result = own(*args)
        event = getattr(self, "_post_reduce_event", None)
        if event is not None:  # the gradients are written on FSDP2's reduce stream: wait there, no host sync
            self.device_handle.current_stream().wait_event(event)
        stepper.step([fp.sharded_param for fp in self.fsdp_params])
        return result

    unit.post_backward = types.MethodType(post_backward, unit)
    handles.append(_Drop(unit, "post_backward"))


class _Drop:
    """A handle whose remove() drops an instance attribute."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float, handles: list[Any]) -> None:
    """Without ``step_in_backward``: clip every gradient by the global norm before each step (a step pre-hook,
    after a GradScaler's unscale), as ``torch.nn.utils.clip_grad_norm_`` does."""

    def clip(opt: torch.optim.Optimizer, *_: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if params:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.__dict__[_NORM_KEY] = norm.full_tensor() if sharding.is_sharded(norm) else norm  # type: ignore[attr-defined]

    handles.append(optimizer.register_step_pre_hook(clip))


def grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The global norm of the last step's gradients, before clipping (a 0-dim fp32 tensor; no sync).

    Measured where :func:`mixprec.prepare` steps in backward or clips (``clip_grad_norm``); ``None`` before the
    first step, or where it does neither (``torch.nn.utils.clip_grad_norm_`` returns the norm there).
    """
    norm: torch.Tensor | None = optimizer.__dict__.get(_NORM_KEY)
    return norm
