"""Observe: what a model does in low precision, before and during training.

Owns :func:`diagnose` (``diagnostics``) and its report (``report``), the fp8 report
(``fp8_diagnostics``), the training :class:`Monitor` (``monitor``), how reports print and plot
(``reporting``), the GEMM reach (``reach``) and the memory plan (``memory_plan``).
May import: every subsystem but ``tune``.
"""
