"""Optimizer state in low precision: block-wise quantized moments.

Owns the quantizer of optimizer state (``quantize``: codebooks, blocks, packed codes), state
tensors kept quantized (``moments``), and one parameter's step of Adam/AdamW (``adam``) and of SGD
with momentum (``sgd``) on them.
May import: the base modules.
"""
