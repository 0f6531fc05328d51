"""Layers: one layer's precision, chosen by hand, planned, or moved during training.

Owns ``set_layer_precision`` (``precision``), ``tune``'s per-layer plan (``plan``: measure each
layer in each precision; ``choice``: choose one per layer) and the :class:`Guard` (``guard``) that moves a
failing layer up, with its probes in the graph (``probes``) and its thresholds and ladder (``ladder``).
May import: the base modules, ``policy``, ``amp``, ``scaling`` and ``fp8``.
"""
