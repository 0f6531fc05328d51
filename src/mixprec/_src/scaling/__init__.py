"""Scaling: the dynamic loss scaler.

Owns :class:`GradScaler` (``scaler``), the scale as a frozen value with one ``adjust``
(``loss_scale``), unscaling and the inf/NaN check (``unscaling``), what happened at each step
(``events``), the scaler's settings (``settings``), fail-fast on a collapsing scale (``fail_fast``), one
iteration's bookkeeping (``iteration``) and the scaler's state with torch's private members (``torch_members``).
May import: the base modules only.
"""
