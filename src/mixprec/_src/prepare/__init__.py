"""Prepare: a model and its optimizer set up for a level (O1, O2, bf16-sr, bf16-pure).

Owns :class:`PrepareConfig` (``config``), :func:`prepare` itself (``prepare``), bf16 stochastic
rounding of the optimizer's updates (``stochastic_rounding``) and Kahan-compensated ones (``kahan``),
quantized and bf16 optimizer state in the optimizer's step (``low_bit_state``, ``bf16_state``), the step in backward
(``step_in_backward``) and the memory report (``memory``).
May import: the base modules, ``gemms``, ``policy``, ``amp``, ``scaling``, ``fp8``, ``layers`` and ``optim``.
"""
