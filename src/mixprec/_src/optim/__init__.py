"""Optimizer state in low precision: block-wise quantized moments.

Owns the precisions state is kept at (``state_precision``), the quantizer of optimizer state
(``quantize``: codebooks, blocks, packed codes), state tensors kept quantized (``moments``), one
parameter's step of Adam/AdamW (``adam``; compiled: ``fused_adam``; on the CPU in C++: ``cpu_adam``) and
of SGD with momentum (``sgd``) on them, and every weight of a param group in one C++ call (``cpu_lists``;
torch's own Adam(W) and SGD, op for op: ``aten_lists``; its fused Adam(W), with O2's copies written beside:
``fused_lists``; the C++ in ``kernels/``).
May import: the base modules.
"""
