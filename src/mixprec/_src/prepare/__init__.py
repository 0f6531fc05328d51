"""Prepare: a model and its optimizer set up for a level (O1, O2, bf16-sr, bf16-pure).

Owns :class:`PrepareConfig` (``config``), :func:`prepare` itself (``prepare``), bf16 stochastic
rounding of the optimizer's updates (``stochastic_rounding``) and Kahan-compensated ones (``kahan``),
quantized optimizer state in the optimizer's step (``low_bit_state``), the step in backward
(``step_in_backward``) and the memory report (``memory``).
May import: the base modules, ``policy``, ``amp``, ``scaling``, ``fp8`` and ``layers``.
"""
