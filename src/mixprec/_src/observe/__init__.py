"""Observe: what a model does in low precision, before and during training.

Owns :func:`diagnose` (``diagnostics``) and its report, drawn as a table and a plot (``report``), the fp8
report (``fp8_diagnostics``), the training :class:`Monitor` (``monitor``), the GEMM reach (``reach``), and
memory: the report of what a prepared model holds (``memory_report``) and the plan of what a recipe will hold
(``memory_plan``, with ``param_bytes``, ``activation_trace`` and ``backward_timeline``).
May import: every subsystem but ``tune``.
"""
