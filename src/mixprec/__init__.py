"""mixprec: mixed-precision training for PyTorch, with policies as data.

``mixprec.autocast`` is a drop-in for ``torch.autocast`` (a region is a torch
autocast region); its precision policy is a value users can read and change
(:class:`Policy`), applied at the dispatcher where it differs from torch's.
"""

from mixprec._src.amp.autocast import (
    autocast,
    get_autocast_dtype,
    get_autocast_policy,
    is_autocast_enabled,
    set_autocast_enabled,
)
from mixprec._src.amp.checkpoint_replay import checkpoint_context
from mixprec._src.amp.custom_function import custom_bwd, custom_fwd, op
from mixprec._src.errors import (
    CheckpointReplayError,
    LossScaleCollapseError,
    MixprecError,
    PolicyError,
    PrepareOrderError,
)
from mixprec._src.fp8.config import AmaxAlgo, Fp8Config, Fp8Recipe
from mixprec._src.fp8.conversion import Fp8Layers, fp8_layers
from mixprec._src.layers.guard import Guard
from mixprec._src.layers.ladder import GuardThresholds, LayerMove
from mixprec._src.layers.plan import LayerChoice
from mixprec._src.layers.precision import LayerPrecision, layer_precision, set_layer_precision
from mixprec._src.layout import to_channels_last
from mixprec._src.observe.diagnostics import diagnose
from mixprec._src.observe.memory_plan import MemoryPlan, memory_plan
from mixprec._src.observe.monitor import Incident, Monitor
from mixprec._src.observe.reach import GemmReach, gemm_reach
from mixprec._src.observe.report import DiagnosticReport
from mixprec._src.op_names import op_name
from mixprec._src.policy.grammar import get_policy
from mixprec._src.policy.rules import NORM_TYPES, ModuleRule, OpCategory, Policy, builtin_policy, default_policy
from mixprec._src.prepare.config import Level, PrepareConfig, StatePrecision
from mixprec._src.prepare.levels import export_fp32, master_params, prepare
from mixprec._src.prepare.memory import MemoryReport, memory_report, state_bytes
from mixprec._src.scaling.scaler import GradScaler, ScalerEvent, ScalerStats
from mixprec._src.step.sr_noise import stochastic_round
from mixprec._src.step.step_in_backward import grad_norm
from mixprec._src.tune.recipe import Applied, Measurement, Recipe, Tolerance
from mixprec._src.tune.search import tune

__version__ = "0.1.0"

__all__ = [
    "CheckpointReplayError",
    "LossScaleCollapseError",
    "MixprecError",
    "PolicyError",
    "PrepareOrderError",
    "AmaxAlgo",
    "Applied",
    "DiagnosticReport",
    "Fp8Config",
    "Fp8Layers",
    "Fp8Recipe",
    "GemmReach",
    "GradScaler",
    "Guard",
    "GuardThresholds",
    "Incident",
    "LayerChoice",
    "LayerMove",
    "LayerPrecision",
    "Level",
    "Measurement",
    "MemoryPlan",
    "MemoryReport",
    "NORM_TYPES",
    "ModuleRule",
    "Monitor",
    "OpCategory",
    "Policy",
    "PrepareConfig",
    "Recipe",
    "ScalerEvent",
    "ScalerStats",
    "StatePrecision",
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
    "fp8_layers",
    "gemm_reach",
    "get_autocast_dtype",
    "grad_norm",
    "get_autocast_policy",
    "get_policy",
    "is_autocast_enabled",
    "layer_precision",
    "master_params",
    "memory_plan",
    "memory_report",
    "op",
    "op_name",
    "prepare",
    "set_autocast_enabled",
    "set_layer_precision",
    "state_bytes",
    "stochastic_round",
    "to_channels_last",
    "tune",
]
