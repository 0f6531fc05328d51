"""Every old path of mixprec's modules, in one place: pickles and imports made by earlier versions still load.

``torch.save(model)`` records the module paths of what it pickles (a converted layer's scaling module, a
config, a bound forward); moving a module must leave its old path importable. Each old path here imports
the module at its new path (the same module object) and warns once with a ``DeprecationWarning`` that names
the new path and the version the old one goes in (:data:`REMOVED_IN`). Nothing else in mixprec forwards old
names: a package that replaced a flat module of the same name (``policy``, ``tune``) hands its unknown
attributes to :func:`forward`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "PACKAGES", "REMOVED_IN", "RENAMED", "forward", "install"]

PACKAGE = "mixprec._src"
#: The version in which the old paths below stop working.
REMOVED_IN = "0.3"

#: Old module (under ``mixprec._src``) -> where it lives now.
MOVED = {
    # the flat layout, before the subsystems were folders
    "training": "input_checks",
    "op_tables": "policy.op_tables",
    "policy_grammar": "policy.grammar",
    "interning": "policy.interning",
    "autocast": "amp.autocast",
    "region": "amp.region",
    "dispatch": "amp.dispatch",
    "module_rules": "amp.module_rules",
    "checkpoint_replay": "amp.checkpoint_replay",
    "custom_function": "amp.custom_function",
    "compiled_backward": "amp.compiled_backward",
    "scaler": "scaling.scaler",
    "loss_scale": "scaling.loss_scale",
    "unscaling": "scaling.unscaling",
    "scaler_events": "scaling.events",
    "scaler_settings": "scaling.settings",
    "fail_fast": "scaling.fail_fast",
    "fp8_config": "fp8.config",
    "fp8_gemm": "fp8.gemm",
    "fp8_linear": "fp8.linear",
    "fp8_conversion": "fp8.conversion",
    "fp8_all_gather": "fp8.all_gather",
    "layer_precision": "layers.precision",
    "guard": "layers.guard",
    "layer_plan": "layers.plan",
    "prepare_config": "prepare.config",
    "master_weights": "prepare.levels",
    "stochastic_rounding": "step.stochastic_rounding",
    "memory": "observe.memory_report",
    "diagnostics": "observe.diagnostics",
    "diagnostic_report": "observe.report",
    "fp8_diagnostics": "observe.fp8_diagnostics",
    "monitor": "observe.monitor",
    "recipe": "tune.recipe",
    # names that repeated their package's
    "prepare.prepare": "prepare.levels",
    "policy.policy": "policy.rules",
    "prepare.memory": "observe.memory_report",
    # folded into the module of what they served
    "observe.reporting": "observe.report",
}

#: A package that replaced the flat module of its name -> the modules whose names its old pickles look up on it.
PACKAGES = {"policy": ("policy.rules", "policy.keep"), "tune": ("tune.search",)}
#: A module -> its old names that moved out of it (older pickles hold them) -> where each is now.
RENAMED = {
    "layers.plan": {"LayerChoice": "layers.choice.LayerChoice"},
    "scaling.scaler": {
        "_Iteration": "scaling.iteration.Iteration",
        "_refresh_per_optimizer_state": "scaling.iteration.refresh_per_optimizer_state",
    },
}


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path goes in mixprec {REMOVED_IN} (a pickle that names it: load it and "
        "save it again)",
        DeprecationWarning,
        stacklevel=3,
    )


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import mixprec._src.<old>`` gives the module at its new path (the same module object), with a warning."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        old = fullname.removeprefix(PACKAGE + ".")
        if old == fullname or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = f"{PACKAGE}.{MOVED[spec.name.removeprefix(PACKAGE + '.')]}"
        _warn(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed at its new path


def install() -> None:
    """Make the old paths importable (once per process)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def forward(module: str, name: str) -> Any:
    """Old attribute ``name`` of ``mixprec._src.<module>`` (a flat module now a package, or a module a name
    moved out of), with a warning.

    Raises:
        AttributeError: no old name ``name`` there (modules and dunders are not forwarded).
    """
    if name.startswith("__") or (module in PACKAGES and importlib.util.find_spec(f"{PACKAGE}.{module}.{name}")):
        raise AttributeError(name)  # a submodule: the import system imports it
    if name in RENAMED.get(module, {}):
        where, _, new = RENAMED[module][name].rpartition(".")
        _warn(f"{PACKAGE}.{module}.{name}", f"{PACKAGE}.{where}.{new}")
        return getattr(importlib.import_module(f"{PACKAGE}.{where}"), new)
    for moved in PACKAGES.get(module, ()):
        found = importlib.import_module(f"{PACKAGE}.{moved}")
        if name in vars(found) and not isinstance(vars(found)[name], ModuleType):  # a submodule imports itself
            _warn(f"{PACKAGE}.{module}.{name}", f"{found.__name__}.{name}")
            return getattr(found, name)
    raise AttributeError(f"module '{PACKAGE}.{module}' has no attribute {name!r}")
