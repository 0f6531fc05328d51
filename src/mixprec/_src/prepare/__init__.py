"""Prepare: a model and its optimizer set up for a level (O1, O2, bf16-sr, bf16-kahan, bf16-pure).

Owns :class:`PrepareConfig` and its options (``config``), :func:`prepare` itself (``levels``), its checks
(``checks``), the modules kept in fp32 (``kept``) and O2's compute copies (``o2_copies``). The optimizer's step
is ``step``'s: prepare plans it once from the config and installs it.
May import: the base modules, ``gemms``, ``policy``, ``amp``, ``scaling``, ``fp8``, ``layers``, ``optim`` and
``step``.
"""
