"""What mixprec's reports and events are: the types :func:`mixprec.diagnose`, :class:`mixprec.Monitor`,
:func:`mixprec.memory_plan`, :func:`mixprec.memory_report`, :func:`mixprec.gemm_reach`,
:class:`mixprec.GradScaler` and :class:`mixprec.Guard` return. Users read them; they rarely build one.
"""

from mixprec._src.layers.ladder import LayerMove
from mixprec._src.observe.memory_plan import MemoryPlan
from mixprec._src.observe.memory_report import MemoryReport
from mixprec._src.observe.monitor import Incident
from mixprec._src.observe.reach import GemmReach
from mixprec._src.observe.report import DiagnosticReport
from mixprec._src.scaling.events import ScalerEvent, ScalerStats

__all__ = [
    "DiagnosticReport",
    "GemmReach",
    "Incident",
    "LayerMove",
    "MemoryPlan",
    "MemoryReport",
    "ScalerEvent",
    "ScalerStats",
]
