"""Find where low precision breaks a model: which layer, which pass, why, and what to do.

``report = mixprec.diagnose(model, inputs, loss_fn, targets=targets)`` runs the batch twice, in fp32 and
under :func:`mixprec.autocast` in the target dtype, forward and backward, and records per
module (qualified name and type) for its output activations and for the gradients that
reach them: the largest magnitude, the fraction past the dtype's largest finite value, the
fraction of non-zeros below its smallest normal (flushed to subnormal or zero), NaN and Inf
counts, and the relative error of the low-precision output against fp32. A dispatch-level
tracer names the first op that produced a NaN or Inf from finite inputs, with its module and
pass. The report lists the modules to keep in fp32 (as rules for autocast, checked by
running them), suggests an initial loss scale, and says whether bf16 avoids the problem.

Everything here syncs with the device: it is a diagnosis, not a training step.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mixprec._src import input_checks
from mixprec._src.amp.autocast import autocast
from mixprec._src.dtypes import parse_dtype
from mixprec._src.fp8.config import Fp8Config, as_fp8_config
from mixprec._src.input_checks import LossFn
from mixprec._src.observe import fp8_diagnostics
from mixprec._src.observe.report import DiagnosticReport, ModuleReport, NonFinite, TensorStats
from mixprec._src.policy.grammar import get_policy
from mixprec._src.policy.rules import ModuleRule, Policy, default_policy

__all__ = ["diagnose"]


def _checkable(t: Any) -> bool:
    """A floating tensor ``isfinite`` takes: not fp8 (an fp8 layer's casts saturate; its GEMM output is checked)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1


# Ops whose output is uninitialised memory (Dropout's mask starts as empty_like): whatever bits it holds
# are not a value the model computed, and the op that fills it in place reads it as an input.
_UNINITIALISED = frozenset(
    {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted", "resize_"}
)


class _FirstNonFinite(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Finds the first op that makes a NaN or Inf out of finite inputs (syncs on every op)."""

    def __init__(self, where: Callable[[], tuple[str, str, str]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.where = where
        self.found: NonFinite | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None and func.overloadpacket.__name__ not in _UNINITIALISED:
            outputs = [t for t in tree_flatten(out)[0] if _checkable(t)]
            bad = [t for t in outputs if t.numel() and not bool(torch.isfinite(t).all())]
            if bad:
                leaves = tree_flatten((args, kwargs))[0]
                inputs = [t for t in leaves if _checkable(t) and t.numel()]
                # Infinities asked for are not a fault: attention masks are torch.full(-inf) or masked_fill(-inf).
                deliberate = not inputs or any(isinstance(v, float) and not math.isfinite(v) for v in leaves)
                if not deliberate and all(bool(torch.isfinite(t).all()) for t in inputs):
                    module, module_type, pass_ = self.where()
                    kind = "nan" if any(bool(torch.isnan(t).any()) for t in bad) else "inf"
                    self.found = NonFinite(module, module_type, pass_, str(func.overloadpacket.__name__), kind)
        return out


class _Recorder:
    """Module hooks that record output statistics, gradients and (fp32 run) outputs."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, keep_outputs: bool) -> None:
        self.finfo = torch.finfo(dtype)
        self.names = {id(m): n for n, m in model.named_modules()}
        self.order: list[nn.Module] = []
        self.activations: dict[int, TensorStats] = {}
        self.gradients: dict[int, TensorStats] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.keep_outputs = keep_outputs
        self.inputs_ok: dict[int, bool] = {}  # inputs finite and within the dtype's range, every call
        self.stack: list[nn.Module] = []
        self.backward_module: nn.Module | None = None
        self.pass_ = "forward"
        self.handles = []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._post, always_call=True))
            self.handles.append(module.register_full_backward_pre_hook(self._bwd_pre))

    def _pre(self, module: nn.Module, args: Any) -> None:
        self.stack.append(module)
        ok = all(
            bool((torch.isfinite(t) & (t.detach().float().abs() <= self.finfo.max)).all())
            for t in tree_flatten(args)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        )
        self.inputs_ok[id(module)] = self.inputs_ok.get(id(module), True) and ok

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if id(module) not in self.activations:
            self.order.append(module)
        stats = self.activations.setdefault(id(module), TensorStats())
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        for t in tensors:
            stats.add(t, self.finfo)
        if self.keep_outputs:
            self.outputs.setdefault(id(module), []).extend(t.detach().float() for t in tensors if t.is_floating_point())

    def _bwd_pre(self, module: nn.Module, grad_output: Any) -> None:
        self.backward_module = module
        stats = self.gradients.setdefault(id(module), TensorStats())
        for t in grad_output:
            if isinstance(t, torch.Tensor):
                stats.add(t, self.finfo)

    def where(self) -> tuple[str, str, str]:
        module = self.stack[-1] if self.pass_ == "forward" and self.stack else self.backward_module
        if module is None:
            return "", "?", self.pass_
        return self.names.get(id(module), ""), type(module).__name__, self.pass_

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _run(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    dtype: torch.dtype,
    policy: Policy | None,
    device_type: str,
    *,
    low_precision: bool,
    keep_outputs: bool,
    steps: int,
) -> tuple[_Recorder, NonFinite | None, float]:
    recorder = _Recorder(model, dtype, keep_outputs)
    tracer = _FirstNonFinite(recorder.where)
    loss_value = math.nan
    try:
        with warnings.catch_warnings():
            # A module whose inputs need no grad still reports the gradient of its outputs: that is all we read.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            # A module returning a dict (a Hugging Face ModelOutput) gets no backward hook call; its
            # submodules report the gradients, so the warning torch prints at every call says nothing new.
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                recorder.pass_ = "forward"
                with tracer:
                    if low_precision:
                        with autocast(device_type, dtype=dtype, policy=policy):
                            loss = input_checks.scalar_loss(input_checks.call_model(model, inputs), loss_fn)
                    else:
                        loss = input_checks.scalar_loss(input_checks.call_model(model, inputs), loss_fn)
                    recorder.pass_ = "backward"
                    loss.backward()  # type: ignore[no-untyped-call]
                loss_value = float(loss.detach())
    finally:
        recorder.remove()
        model.zero_grad(set_to_none=True)
    return recorder, tracer.found, loss_value


def _rel_error(low: list[torch.Tensor], ref: list[torch.Tensor]) -> float | None:
    if not low or len(low) != len(ref):
        return None
    num = sum(float((a - b).square().sum()) for a, b in zip(low, ref, strict=True) if a.shape == b.shape)
    den = sum(float(b.square().sum()) for b in ref)
    if den == 0 or math.isnan(num):
        return None if math.isnan(num) else 0.0
    return math.sqrt(num / den)


def _origins(recorder: _Recorder, flagged: set[int]) -> list[str]:
    """Flagged modules none of whose flagged descendants explain them: the innermost culprits."""
    names = recorder.names
    out = []
    modules = {id(m): m for m in recorder.order}
    for module_id in flagged:
        module = modules[module_id]
        children = {id(c) for c in module.modules() if c is not module}
        if not (children & flagged):
            out.append(names[module_id])
    return sorted(out, key=lambda n: [names[id(m)] for m in recorder.order].index(n))


def diagnose(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    targets: Any = None,
    dtype: torch.dtype | str = torch.float16,
    policy: Policy | str | None = None,
    steps: int = 1,
    rel_error_limit: float | None = None,
    fp8: Fp8Config | str | None = None,
) -> DiagnosticReport:
    """Run ``model`` on ``inputs`` in fp32 and in ``dtype`` and report where low precision breaks it.

    The loss is ``loss_fn(model(inputs), targets)`` when ``targets`` is given, else
    ``loss_fn(model(inputs))``: for a batch ``(x, y)`` call ``diagnose(model, x, loss_fn, targets=y)``
    with the ``loss_fn(output, targets)`` you train with (``mixprec diagnose --loss`` takes the same).

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Linear(4, 2)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> report = mixprec.diagnose(model, x, torch.nn.functional.cross_entropy, targets=y)
        >>> report.first_nonfinite is None
        True

    Args:
        model: the model (its parameters are not changed; gradients are cleared afterwards).
        inputs: a tensor, a tuple/list of positional inputs, or a dict of keyword inputs.
        loss_fn: ``(output, targets) -> scalar loss`` with ``targets``, else ``output -> scalar loss``;
            default: the mean square of the floating outputs.
        targets: passed to ``loss_fn`` after the output (any value: a tensor, a tuple, a dict);
            needs ``loss_fn``.
        dtype: the low precision to check (fp16 by default, where things break).
        policy: the autocast policy to check (default: the device's built-in one).
        steps: forward/backward passes per run (statistics accumulate).
        rel_error_limit: also keep modules whose output differs from fp32 by more than this
            (relative L2); default: only overflow and NaN/Inf.
        fp8: also run a copy of the model with these fp8 layers (a recipe name or an
            :class:`Fp8Config`) and report per fp8 layer its SQNR and cast statistics
            (``report.fp8``, worst first; ``report.fp8_worst()`` names the layers that lose most).

    Raises:
        ValueError: a model without parameters, inputs or targets on another device, a loss that is not
            a scalar, ``targets`` without ``loss_fn``.
        TypeError: ``loss_fn`` is not callable; an ``(inputs, targets)`` pair passed as ``inputs`` (the
            message says to pass ``targets=``).
    """
    dtype = parse_dtype(dtype, what="diagnose dtype", allowed=(torch.float16, torch.bfloat16))
    device = input_checks.check_inputs(model, (inputs, targets), loss_fn)
    loss_of: LossFn | None = loss_fn
    if targets is not None:
        if loss_fn is None:
            raise ValueError("targets= needs loss_fn(output, targets) to compute the loss with them")
        loss_of = functools.partial(input_checks.with_targets, loss_fn, targets)

    device_type = device.type
    notes: list[str] = []
    base = get_policy(policy, device_type) if policy is not None else default_policy(device_type)
    was_training = model.training
    try:
        (ref, ref_first, loss_fp32), (low, first, loss_low) = [
            _run(
                model,
                inputs,
                loss_of,
                dtype,
                base,
                device_type,
                low_precision=low_precision,
                keep_outputs=True,
                steps=steps,
            )
            for low_precision in (False, True)
        ]
    finally:
        model.train(was_training)
    reports = []
    flagged: set[int] = set()
    # A module that makes NaN/Inf in fp32 as well needs a fix in the computation, not in the precision.
    fp32_broken = {low.names[k] for k, st in ref.activations.items() if st.nan or st.inf}
    if ref_first is not None:
        fp32_broken.add(ref_first.module)
    for module in low.order:
        key = id(module)
        acts = ref.activations.get(key, TensorStats())
        grads = ref.gradients.get(key, TensorStats())
        low_acts = low.activations.get(key, TensorStats())
        low_grads = low.gradients.get(key, TensorStats())
        rel = _rel_error(low.outputs.get(key, []), ref.outputs.get(key, []))
        nan, inf = low_acts.nan + low_grads.nan, low_acts.inf + low_grads.inf
        reports.append(ModuleReport(low.names[key], type(module).__name__, acts, grads, nan, inf, rel))
        # Flag where a problem starts, not the modules downstream that receive it.
        overflow_made = acts.overflow and ref.inputs_ok.get(key, True)
        precision_made = (low_acts.nan or low_acts.inf) and low.inputs_ok.get(key, True)
        precision_made = precision_made and low.names[key] not in fp32_broken
        too_far = rel_error_limit is not None and rel is not None and rel > rel_error_limit
        if overflow_made or precision_made or too_far:
            flagged.add(key)
    if first is not None and first.module in fp32_broken:
        notes.append(f"{first.module or '<model>'} makes NaN/Inf in fp32 too: fix the computation, not the precision")
    elif first is not None:
        flagged.update(id(m) for m in low.order if low.names[id(m)] == first.module)
    keep = _origins(low, flagged) if flagged else []
    rules_fix_it: bool | None = None
    # Keep what the rules' run still flags (consumers of a kept module's large outputs), up to 3 rounds.
    for _ in range(3):
        if not keep:
            break
        trial = base.with_rules((*base.module_rules, ModuleRule(names=tuple(keep))))
        check, found, _ = _run(
            model, inputs, loss_of, dtype, trial, device_type, low_precision=True, keep_outputs=False, steps=steps
        )
        still = {id(m) for m in check.order if check.activations[id(m)].nan or check.activations[id(m)].inf}
        rules_fix_it = not still and (found is None or found.module in fp32_broken)
        if rules_fix_it:
            break
        extra = [n for n in _origins(check, still) if n not in keep] if still else []
        if not extra:
            break
        keep = sorted(set(keep) | set(extra), key=[low.names[id(m)] for m in low.order].index)
    finfo = torch.finfo(dtype)
    grad_max = max((s.absmax for s in ref.gradients.values()), default=0.0)
    grad_min = min((s.min_nonzero for s in ref.gradients.values()), default=math.inf)
    scale = 2.0**16
    if grad_max > 0:
        # The largest power of two that keeps the largest gradient 8x below the dtype's maximum.
        scale = 2.0 ** max(0, min(24, math.floor(math.log2(finfo.max / 8 / grad_max))))
    if dtype is torch.bfloat16:
        scale = 1.0
        notes.append("bf16 has fp32's range: no loss scaling needed")
    if math.isfinite(grad_min) and grad_min * scale < finfo.tiny and dtype is torch.float16:
        notes.append(f"the smallest gradients ({grad_min:.3g}) stay below fp16's normal range even at scale {scale:g}")
    big = max((s.absmax for s in ref.activations.values()), default=0.0)
    fp16_trouble = any(r.activations.overflow or r.gradients.underflow or r.nan or r.inf for r in reports)
    bf16_avoids: bool | None = None
    if dtype is torch.float16 and fp16_trouble:
        bf16_avoids = not fp32_broken and big < torch.finfo(torch.bfloat16).max
    fp8_reports = []
    fp8_config = as_fp8_config(fp8)
    if fp8_config is not None:
        fp8_reports = fp8_diagnostics.fp8_layer_reports(
            model, inputs, loss_of, fp8_config, dtype=dtype, policy=base, device_type=device_type
        )
    return DiagnosticReport(
        dtype, reports, first, keep, rules_fix_it, scale, bf16_avoids, notes, loss_low, loss_fp32, fp8_reports
    )
