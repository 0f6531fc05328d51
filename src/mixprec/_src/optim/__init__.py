"""Optimizer state in low precision: block-wise quantized moments.

Owns the quantizer of optimizer state (``quantize``: codebooks, blocks, packed codes).
May import: the base modules.
"""
