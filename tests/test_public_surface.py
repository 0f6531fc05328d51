"""The front door: ``mixprec.__all__`` grouped as the README's API section lists it, every name it had still
importable, result types in their topic namespaces."""

from __future__ import annotations

import ast
import re

import mixprec
import mixprec.fp8
import mixprec.observe
import mixprec.tuning
from helpers import ROOT

#: mixprec.__all__ before it was grouped: each stays importable from mixprec.
EARLIER = [
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


def _groups() -> dict[str, list[str]]:
    """``__all__``'s groups: each comment line in it and the names after it."""
    source = (ROOT / "src/mixprec/__init__.py").read_text()
    block = source[source.index("__all__ = [") :]
    block = block[: block.index("]\n")]
    groups: dict[str, list[str]] = {}
    for line in block.splitlines()[1:]:
        comment = re.match(r"\s*# ([^:]+)", line)
        if comment:
            current = groups.setdefault(comment.group(1).strip(), [])
        elif line.strip().startswith('"'):
            current.append(ast.literal_eval(line.strip().rstrip(",")))
    return groups


def test_every_earlier_name_still_imports_and_the_result_types_live_in_their_namespaces() -> None:
    assert [n for n in EARLIER if not hasattr(mixprec, n)] == []
    assert len(mixprec.__all__) == len(set(mixprec.__all__)) and all(hasattr(mixprec, n) for n in mixprec.__all__)
    for namespace in (mixprec.fp8, mixprec.observe, mixprec.tuning):
        for name in namespace.__all__:
            if hasattr(mixprec, name):
                assert getattr(mixprec, name) is getattr(namespace, name), name
    results = {*mixprec.observe.__all__, "Fp8Layers", "Applied", "Measurement", "LayerChoice"}
    assert results & set(mixprec.__all__) == set()  # a result type is read, not called: not at the front door


def test_the_readme_lists_every_group_and_name_of_all() -> None:
    readme = (ROOT / "README.md").read_text()
    api = readme[readme.index("## API") : readme.index("## Documentation")]
    groups = _groups()
    assert sum(len(names) for names in groups.values()) == len(mixprec.__all__)
    for heading, names in groups.items():
        line = re.search(rf"- \*\*{re.escape(heading)}\*\*: (.*?)(?=\n- |\n\n)", api, re.DOTALL)
        assert line is not None, heading
        listed = re.findall(r"`(\w+)`", line.group(1))
        assert listed == [n for n in names if n != "__version__"], heading
