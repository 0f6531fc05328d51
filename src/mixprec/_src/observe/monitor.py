"""A training-time monitor that names the module where a NaN or Inf first appeared.

While steps are healthy it does no tensor work at all: a hook on the model keeps references
to the latest forward's inputs, the random-number state and the autocast settings in force.
When a step goes wrong (the :class:`~mixprec.GradScaler` it watches skips a step, or
:meth:`Monitor.check` sees a non-finite loss) it replays that forward pass, with the same
inputs, random numbers and precision, and the weights the skipped step left unchanged, with
checks on every leaf module's output (syncing), then a backward pass through
``torch.autograd.grad`` (parameters' ``.grad`` untouched) if the forward was clean. Buffers
such as BatchNorm statistics are restored after the replay.

The backward replay differentiates the sum of the model's floating outputs (the monitor does
not know the loss), which finds NaN made by a module's backward (0/0, sqrt at 0) but not one
that only the true loss's gradient would trigger. Inputs changed in place after the forward
are replayed as they are then.

With ``fp8_stats=True`` the fp8 layers of a model prepared with ``fp8=`` record, at every call,
the amax, scale and saturated and flushed fractions of each tensor they cast (a few element-wise
ops per cast, no sync); :meth:`Monitor.fp8_stats` reads the latest ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mixprec._src.amp import checkpoint_replay
from mixprec._src.amp.autocast import TorchAutocast
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.observe import fp8_diagnostics
from mixprec._src.scaling.scaler import GradScaler, ScalerEvent

__all__ = ["Incident", "Monitor"]

logger = logging.getLogger("mixprec.monitor")


@dataclasses.dataclass(frozen=True)
class Incident:
    """Where a bad step's first non-finite value was seen."""

    reason: str  # "skipped step" or "non-finite loss"
    module: str | None  # qualified name; None when every recorded value was finite
    module_type: str | None
    pass_: str | None  # "forward" or "backward"

    def __str__(self) -> str:
        if self.module is None:
            return f"{self.reason}: every module output and output gradient was finite (check the loss and inputs)"
        return f"{self.reason}: first non-finite value in the {self.pass_} pass at {self.module} ({self.module_type})"


class Monitor:
    """Watch a model for NaN/Inf at no host cost while steps are healthy.

    Args:
        model: the model; hooks go on its leaf modules (and are removed by :meth:`close`).
        scaler: a GradScaler whose skipped steps trigger an inspection.
        callback: called with each :class:`Incident` (also logged on ``mixprec.monitor`` at WARNING).
        fp8_stats: record per fp8 layer cast statistics, read by :meth:`fp8_stats`.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> monitor = mixprec.Monitor(model)
        >>> loss = model(torch.full((2, 4), float("nan"))).sum()
        >>> str(monitor.check(loss))
        'non-finite loss: first non-finite value in the forward pass at 0 (Linear)'
        >>> monitor.close()
    """

    def __init__(
        self,
        model: nn.Module,
        scaler: GradScaler | None = None,
        *,
        callback: Callable[[Incident], None] | None = None,
        fp8_stats: bool = False,
    ) -> None:
        self.callback = callback
        self.incidents: list[Incident] = []
        self._model = model
        self._names = {id(m): n for n, m in model.named_modules()}
        self._types = {id(m): type(m).__name__ for m in model.modules()}
        self._last: _Forward | None = None
        self._replaying = False
        self._handles = [model.register_forward_pre_hook(self._remember, with_kwargs=True)]
        self._scaler = scaler
        self._fp8_stats = fp8_stats
        if fp8_stats:
            if fp8_conversion.fp8_layers(model) is None:
                raise ValueError(
                    "fp8_stats=True needs a model with fp8 layers: mixprec.prepare(model, optimizer, "
                    "level, fp8=...) first"
                )
            fp8_diagnostics.set_recording(model, True)
        if scaler is not None:
            scaler.add_listener(self._on_scaler_event)

    def _remember(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._replaying:
            # Compiled, the hook is traced into the model's graph (no break): torch's generator state cannot
            # be read there, and a compiled forward draws its random numbers otherwise than an eager replay.
            rng = None if torch.compiler.is_compiling() else torch.get_rng_state()
            self._last = _Forward(args, kwargs, rng, _precision())

    def _on_scaler_event(self, event: ScalerEvent) -> None:
        if event.kind == "skip":
            self._report("skipped step")

    def check(self, loss: torch.Tensor) -> Incident | None:
        """Inspect if ``loss`` is not finite (reading it syncs; call it where you read the loss anyway)."""
        if bool(torch.isfinite(loss.detach()).all()):
            return None
        return self._report("non-finite loss")

    def _report(self, reason: str) -> Incident:
        incident = Incident(reason, None, None, None)
        if self._last is not None:
            found = self._replay(self._last)
            if found is not None:
                incident = self._incident(reason, *found)
        self.incidents.append(incident)
        logger.warning("%s", incident)
        if self.callback is not None:
            self.callback(incident)
        return incident

    def _replay(self, last: _Forward) -> tuple[int, str] | None:
        model = self._model
        outputs: list[tuple[int, list[torch.Tensor]]] = []
        grads: list[tuple[int, torch.Tensor]] = []

        def record(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            module_id = id(module)
            outputs.append((module_id, tensors))

            def on_grad(grad: torch.Tensor) -> None:
                grads.append((module_id, grad))

            for t in tensors:
                if t.requires_grad:
                    t.register_hook(on_grad)  # type: ignore[no-untyped-call]

        leaves = [m for m in model.modules() if not any(True for _ in m.children())]
        handles = [m.register_forward_hook(record) for m in leaves]
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self._replaying = True
        try:
            with torch.random.fork_rng(devices=[]), _restore_precision(last.precision):
                if last.rng is not None:
                    torch.set_rng_state(last.rng)
                with torch.enable_grad():
                    out = model(*last.args, **last.kwargs)
            with torch.no_grad():
                for module_id, tensors in outputs:
                    if not all(bool(torch.isfinite(t).all()) for t in tensors):
                        return module_id, "forward"
            floats = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            params = [p for p in model.parameters() if p.requires_grad]
            if floats and params and any(t.requires_grad for t in floats):
                total = torch.stack([t.float().sum() for t in floats if t.requires_grad]).sum()
                torch.autograd.grad(total, params, allow_unused=True)
                with torch.no_grad():
                    for module_id, grad in grads:  # backward order: nearest the output first
                        if not bool(torch.isfinite(grad).all()):
                            return module_id, "backward"
            return None
        finally:
            self._replaying = False
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])

    def _incident(self, reason: str, module_id: int, pass_: str) -> Incident:
        return Incident(reason, self._names.get(module_id, "?"), self._types.get(module_id, "?"), pass_)

    def fp8_stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per fp8 layer and cast role (``input``, ``weight``, ``grad_output``) of the latest step: ``amax``,
        ``scale``, ``saturated``, ``flushed`` (reading them syncs). Needs ``Monitor(..., fp8_stats=True)``."""
        if not self._fp8_stats:
            raise ValueError(
                "this monitor does not record fp8 statistics; create it with Monitor(model, fp8_stats=True)"
            )
        return fp8_diagnostics.cast_stats(self._model)

    def close(self) -> None:
        """Remove the hooks, stop listening to the scaler and recording fp8 statistics."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._fp8_stats:
            fp8_diagnostics.set_recording(self._model, False)
        if self._scaler is not None:
            self._scaler.remove_listener(self._on_scaler_event)


@dataclasses.dataclass
class _Forward:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: torch.Tensor | None  # None: the forward was compiled
    precision: dict[str, Any]


def _precision() -> dict[str, Any]:
    """The autocast settings in force (mixprec's and torch's), to replay a forward in them."""
    policies = checkpoint_replay.snapshot()
    torch_on = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
    return {"policies": policies, "torch": torch_on}


@contextlib.contextmanager
def _restore_precision(precision: dict[str, Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, dtype in precision["torch"].items():
            stack.enter_context(TorchAutocast(device_type, dtype=dtype))
        stack.enter_context(checkpoint_replay.replay(precision["policies"]))
        yield
