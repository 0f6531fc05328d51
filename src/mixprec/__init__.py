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
from mixprec._src.fp8.conversion import fp8_layers
from mixprec._src.layers.guard import Guard
from mixprec._src.layers.ladder import GuardThresholds
from mixprec._src.layers.precision import LayerPrecision, layer_precision, set_layer_precision
from mixprec._src.layout import to_channels_last
from mixprec._src.observe.diagnostics import diagnose
from mixprec._src.observe.memory_plan import memory_plan
from mixprec._src.observe.memory_report import memory_report, state_bytes
from mixprec._src.observe.monitor import Monitor
from mixprec._src.observe.reach import gemm_reach
from mixprec._src.op_names import op_name
from mixprec._src.policy.grammar import get_policy
from mixprec._src.policy.rules import NORM_TYPES, ModuleRule, OpCategory, Policy, builtin_policy, default_policy
from mixprec._src.prepare.config import Level, PrepareConfig, StatePrecision
from mixprec._src.prepare.levels import export_fp32, master_params, prepare
from mixprec._src.scaling.scaler import GradScaler
from mixprec._src.step.sr_noise import stochastic_round
from mixprec._src.step.step_in_backward import grad_norm
from mixprec._src.tune.recipe import Recipe, Tolerance
from mixprec._src.tune.search import tune

# Result types, importable here as in earlier versions; they live in the topic namespaces.
from mixprec.fp8 import Fp8Layers as Fp8Layers
from mixprec.observe import DiagnosticReport as DiagnosticReport
from mixprec.observe import GemmReach as GemmReach
from mixprec.observe import Incident as Incident
from mixprec.observe import LayerMove as LayerMove
from mixprec.observe import MemoryPlan as MemoryPlan
from mixprec.observe import MemoryReport as MemoryReport
from mixprec.observe import ScalerEvent as ScalerEvent
from mixprec.observe import ScalerStats as ScalerStats
from mixprec.tuning import Applied as Applied
from mixprec.tuning import LayerChoice as LayerChoice
from mixprec.tuning import Measurement as Measurement

__version__ = "0.1.0"

# Grouped as a user meets them; result types live in mixprec.fp8, mixprec.observe and mixprec.tuning
# (their old top-level names, imported above, still work).
__all__ = [
    # autocast: the drop-in for torch.autocast, its policy as data
    "autocast",
    "get_autocast_dtype",
    "get_autocast_policy",
    "is_autocast_enabled",
    "set_autocast_enabled",
    "custom_fwd",
    "custom_bwd",
    "op",
    "checkpoint_context",
    # policies: which ops and modules run in which precision
    "Policy",
    "get_policy",
    "builtin_policy",
    "default_policy",
    "OpCategory",
    "ModuleRule",
    "NORM_TYPES",
    "op_name",
    # loss scaling: the drop-in for torch.amp.GradScaler
    "GradScaler",
    # a model and its optimizer at a precision level
    "prepare",
    "PrepareConfig",
    "Level",
    "StatePrecision",
    "export_fp32",
    "master_params",
    "grad_norm",
    "stochastic_round",
    "to_channels_last",
    # fp8 and per-layer precision
    "Fp8Config",
    "Fp8Recipe",
    "AmaxAlgo",
    "fp8_layers",
    "set_layer_precision",
    "layer_precision",
    "LayerPrecision",
    "Guard",
    "GuardThresholds",
    "gemm_reach",
    # diagnostics and memory
    "diagnose",
    "Monitor",
    "memory_plan",
    "memory_report",
    "state_bytes",
    # tuning: the fastest safe recipe, measured here
    "tune",
    "Recipe",
    "Tolerance",
    # errors
    "MixprecError",
    "CheckpointReplayError",
    "LossScaleCollapseError",
    "PolicyError",
    "PrepareOrderError",
    "__version__",
]
