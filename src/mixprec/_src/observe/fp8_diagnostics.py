"""Per-layer fp8 statistics for :func:`mixprec.diagnose` and :class:`mixprec.Monitor`.

For each fp8 layer: per cast tensor (input, weight, grad_output) the amax, the scale, the
fraction saturated at the format's max (a block-scaled layer's: the fraction of blocks) and the fraction
flushed to zero; and the layer's SQNR,
its fp8 output against an fp32 linear on the same input and weights (the layer's own error, not
what it inherits). :func:`fp8_layer_reports` runs one forward and backward to measure them.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from mixprec._src import input_checks
from mixprec._src.amp.autocast import autocast
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8.config import Fp8Config
from mixprec._src.gemms import kinds
from mixprec._src.input_checks import LossFn
from mixprec._src.numerics import sqnr
from mixprec._src.observe.report import Fp8LayerReport
from mixprec._src.policy.rules import Policy
from mixprec._src.prepare.levels import prepared_state

__all__ = ["cast_stats", "fp8_layer_reports", "set_recording"]


def cast_stats(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """The last recorded cast statistics of each fp8 layer of ``model``, as host numbers (syncs)."""
    layers = fp8_conversion.fp8_layers(model)
    if layers is None:
        return {}
    return {name: {role: s.as_floats() for role, s in scaling.stats.items()} for name, scaling in layers.scalings()}


def set_recording(model: nn.Module, on: bool) -> None:
    """Turn recording of cast statistics on or off in every fp8 layer of ``model`` (costs a few ops per cast)."""
    layers = fp8_conversion.fp8_layers(model)
    for _, scaling in layers.scalings() if layers is not None else []:
        scaling.recording = on
        if not on:
            scaling.clear_stats()


def fp8_layer_reports(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    config: Fp8Config,
    *,
    dtype: torch.dtype,
    policy: Policy,
    device_type: str,
) -> list[Fp8LayerReport]:
    """One forward and backward of a copy of ``model`` with ``config``'s fp8 layers, worst SQNR first.

    Raises:
        ValueError: a model :func:`mixprec.prepare` set up (its copy would share the original's state).
    """
    if prepared_state(model) is not None:
        raise ValueError(
            "diagnose(fp8=...) measures fp8 on a copy of the model as it was before mixprec.prepare; "
            "pass that model (or mixprec.export_fp32(model) of this one)"
        )
    trial = copy.deepcopy(model)
    fp8_conversion.revert(trial)
    layers = fp8_conversion.convert(trial, config, set())
    set_recording(trial, True)
    outputs: dict[str, float] = {}

    def measure(name: str, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        with torch.no_grad():
            bias = kinds.bias_of(module)
            exact = kinds.compute(
                module, args[0].double(), kinds.weight_of(module).double(), None if bias is None else bias.double()
            )
            outputs[name] = sqnr(out, exact)

    handles = [
        module.register_forward_hook(lambda m, a, o, name=name: measure(name, m, a, o))
        for name, module in layers.modules.items()
    ]
    try:
        with autocast(device_type, dtype=dtype, policy=policy):
            loss = input_checks.scalar_loss(input_checks.call_model(trial, inputs), loss_fn)
        loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for handle in handles:
            handle.remove()
    stats = cast_stats(trial)
    block = config.block
    reports = [Fp8LayerReport(n, outputs.get(n, math.nan), stats.get(n, {}), block) for n in layers.converted]
    return sorted(reports, key=lambda r: r.sqnr)
