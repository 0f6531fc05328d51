"""mixprec's implementation. Import from ``mixprec``; nothing here is public.

The subsystems, lowest first; each may import those before it, never one after it
(``tests/test_layering.py`` checks it):

==========  ===========================================================================
(base)      the modules at this level: errors, dtypes, op names, casting, bound forwards,
            input checks, layouts, numerics, timing, sharding probes, per-thread state
gemms/      GEMM layers: their kinds (linear, Conv1D, attention projections, convolutions),
            the routed attention forward, the fused paths kept off, the FLOP count
policy/     what runs in which precision: op tables, ``Policy``, its grammar, interning
amp/        autocast: the region, the dispatch kernel, module rules, checkpoint replay
scaling/    the loss scaler: ``GradScaler``, its rule, unscaling, events, settings
fp8/        fp8 linears: config, GEMMs, the layer, conversion, FSDP2 all-gather
layers/     per-layer precision: ``set_layer_precision``, the per-layer plan, ``Guard``
optim/      optimizer state in low precision: the block-wise quantizer of moments
prepare/    ``prepare``'s levels: kept modules, O2's copies, bf16 stochastic rounding, memory
observe/    diagnose, the fp8 report, ``Monitor``, their tables and plots
tune/       ``Recipe`` and ``tune``
==========  ===========================================================================

Modules moved here from the flat layout of earlier versions keep their old paths
(``mixprec._src.master_weights`` is ``mixprec._src.prepare.prepare``): pickles of models record
those paths (``torch.save(model)`` of a model with converted layers), and they still load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

#: Old flat module -> where it lives now (for pickles made by earlier versions).
MOVED = {
    "training": "input_checks",
    "op_tables": "policy.op_tables", "policy_grammar": "policy.grammar", "interning": "policy.interning",
    "autocast": "amp.autocast", "region": "amp.region", "dispatch": "amp.dispatch", "module_rules": "amp.module_rules",
    "checkpoint_replay": "amp.checkpoint_replay", "custom_function": "amp.custom_function",
    "compiled_backward": "amp.compiled_backward",
    "scaler": "scaling.scaler", "loss_scale": "scaling.loss_scale", "unscaling": "scaling.unscaling",
    "scaler_events": "scaling.events", "scaler_settings": "scaling.settings", "fail_fast": "scaling.fail_fast",
    "fp8_config": "fp8.config", "fp8_gemm": "fp8.gemm", "fp8_linear": "fp8.linear", "fp8_conversion": "fp8.conversion",
    "fp8_all_gather": "fp8.all_gather",
    "layer_precision": "layers.precision", "guard": "layers.guard", "layer_plan": "layers.plan",
    "prepare_config": "prepare.config", "master_weights": "prepare.prepare",
    "stochastic_rounding": "step.stochastic_rounding", "memory": "prepare.memory",
    "diagnostics": "observe.diagnostics", "diagnostic_report": "observe.report",
    "fp8_diagnostics": "observe.fp8_diagnostics", "monitor": "observe.monitor",
    "recipe": "tune.recipe",
}  # fmt: skip
# Two old modules are now packages of the same name (policy/, tune/): their __init__ forward old names.


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import mixprec._src.<old>`` gives the module at its new path (the same module object)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed at its new path


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())
