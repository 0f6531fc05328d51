"""``mixprec bench``: fp32, torch.amp and mixprec side by side on real training.

``run(BenchConfig(...))`` trains each workload in each mode and returns a
:class:`BenchReport`; :mod:`mixprec.bench.report` writes it as JSON, Markdown and
a PNG. The CLI (``mixprec bench``) wraps it with progress bars.
"""

from mixprec.bench.devices import resolve_device, resolve_dtype
from mixprec.bench.modes import MODES, Mode, register_mode
from mixprec.bench.runner import BenchConfig, BenchInterrupted, BenchReport, ModeResult, run
from mixprec.bench.workloads import WORKLOADS, Workload

__all__ = [
    "MODES",
    "WORKLOADS",
    "BenchConfig",
    "BenchInterrupted",
    "BenchReport",
    "Mode",
    "ModeResult",
    "Workload",
    "register_mode",
    "resolve_device",
    "resolve_dtype",
    "run",
]
