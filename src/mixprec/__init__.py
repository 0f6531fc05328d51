"""mixprec: mixed-precision training for PyTorch, with policies as data.

``mixprec.autocast`` is a drop-in for ``torch.autocast`` (a region is a torch
autocast region); its precision policy is a value users can read and change
(:class:`Policy`), applied at the dispatcher where it differs from torch's.
"""

from mixprec.autocast import (
    autocast,
    checkpoint_context,
    get_autocast_dtype,
    get_autocast_policy,
    is_autocast_enabled,
    set_autocast_enabled,
)
from mixprec.custom_function import custom_bwd, custom_fwd, op
from mixprec.diagnostics import DiagnosticReport, diagnose
from mixprec.layout import to_channels_last
from mixprec.master_weights import Level, export_fp32, master_params, prepare, state_bytes
from mixprec.memory import MemoryReport, memory_report
from mixprec.monitor import Incident, Monitor
from mixprec.policy import (
    NORM_TYPES,
    ModuleRule,
    OpCategory,
    Policy,
    builtin_policy,
    default_policy,
    get_policy,
    op_name,
)
from mixprec.scaler import GradScaler, ScalerEvent, ScalerStats
from mixprec.stochastic_rounding import stochastic_round
from mixprec.tune import Applied, Measurement, Recipe, Tolerance, tune

__version__ = "0.1.0"

__all__ = [
    "Applied",
    "DiagnosticReport",
    "GradScaler",
    "Incident",
    "Level",
    "Measurement",
    "MemoryReport",
    "NORM_TYPES",
    "ModuleRule",
    "Monitor",
    "OpCategory",
    "Policy",
    "Recipe",
    "ScalerEvent",
    "ScalerStats",
    "Tolerance",
    "__version__",
    "autocast",
    "builtin_policy",
    "checkpoint_context",
    "custom_bwd",
    "custom_fwd",
    "default_policy",
    "diagnose",
    "export_fp32",
    "get_autocast_dtype",
    "get_autocast_policy",
    "get_policy",
    "is_autocast_enabled",
    "master_params",
    "memory_report",
    "op",
    "op_name",
    "prepare",
    "set_autocast_enabled",
    "state_bytes",
    "stochastic_round",
    "to_channels_last",
    "tune",
]
