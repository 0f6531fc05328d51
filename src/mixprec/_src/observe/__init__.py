"""Observe: what a model does in low precision, before and during training.

Owns :func:`diagnose` (``diagnostics``) and its report (``report``), the fp8 report
(``fp8_diagnostics``), the training :class:`Monitor` (``monitor``) and how reports print and plot
(``reporting``).
May import: every subsystem but ``tune``.
"""
