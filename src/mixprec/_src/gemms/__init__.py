"""GEMM layers: what a layer whose GEMM mixprec reaches is, wherever a model keeps it.

Owns the kinds of GEMM layer (``kinds``: ``nn.Linear`` and its forwarding subclasses, transformers'
``Conv1D``, ``nn.MultiheadAttention``'s packed in-projection and its ``out_proj``, convolutions),
the routed attention forward that makes an attention's projections layers of their own
(``attention``), keeping torch's fused inference paths from skipping them (``fused_paths``), the one
enumeration of a model's layers every feature uses (``sites``) and the
dry run that counts each layer's share of the forward's GEMM FLOPs (``flops``).
May import: the base modules.
"""
