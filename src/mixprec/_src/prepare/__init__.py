"""Prepare: a model and its optimizer set up for a level (O1, O2, bf16-sr, bf16-pure).

Owns :class:`PrepareConfig` (``config``), :func:`prepare` itself (``prepare``), bf16 stochastic
rounding of the optimizer's updates (``stochastic_rounding``) and the memory report (``memory``).
May import: the base modules, ``policy``, ``amp``, ``scaling``, ``fp8`` and ``layers``.
"""
