"""Adam and AdamW with block-wise quantized moments: the state, one parameter's step.

A parameter of at least :data:`MIN_NUMEL` values keeps its moments as codes and block scales
(``optim.quantize``; 8 or 4 bits on codebooks, or e4m3 values for ``"fp8"``): ``exp_avg`` signed,
``exp_avg_sq`` unsigned, as four tensors in the
optimizer's state (``exp_avg_codes``, ``exp_avg_scale``, ``exp_avg_sq_codes``,
``exp_avg_sq_scale``), so ``optimizer.state_dict()`` and checkpoints carry them as they are
(``load_state_dict`` would cast them to the parameter's dtype; prepare's hooks keep them as saved). A
smaller one (biases, norms: a sliver of the memory, and the most sensitive) keeps fp32 moments and
torch's own step, as torchao's low-bit optimizers keep them.

One step of one parameter, in fp32 on transient copies of that parameter's tensors only (torchao's
``single_param_adam``, the same operations in the same order)::

    AdamW: p <- p - lr * wd * p            Adam: g <- g + wd * p
    m <- lerp(dequant(m), g, 1 - beta1)    v <- lerp(dequant(v), g**2, 1 - beta2)    (stored quantized)
    p <- p - lr * (m / (1 - beta1**t)) / (sqrt(v) / sqrt(1 - beta2**t) + eps)

The moments this step uses are the fp32 ones; what is stored for the next is their quantization.
Nothing here syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec._src.optim import quantize as q

__all__ = [
    "FORMATS",
    "KEYS",
    "STATE_PRECISIONS",
    "MIN_NUMEL",
    "adam_step",
    "fp32_state",
    "is_quantized",
    "quantized_state",
]

#: State precision -> (bits, block size): torchao's formats (fp8: e4m3 values, ``AdamWFp8``'s).
FORMATS = {"8bit": (8, 256), "4bit": (4, 128), "fp8": (8, 256)}
#: What ``PrepareConfig.optimizer_state`` takes: the moments as the level keeps them, or quantized.
STATE_PRECISIONS = ("fp32", *FORMATS)
#: Parameters with fewer values keep fp32 moments.
MIN_NUMEL = 4096
#: The state keys of a quantized parameter.
KEYS = ("step", "exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale")
_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))


def is_quantized(state: dict[str, Any]) -> bool:
    return "exp_avg_codes" in state


def _store(state: dict[str, Any], name: str, value: torch.Tensor, precision: str, signed: bool,
           capacity: int) -> None:  # fmt: skip
    bits, block = FORMATS[precision]
    if capacity > value.numel():  # zeros up to the room every rank's shard of this parameter takes
        value = torch.cat([value.reshape(-1), value.new_zeros(capacity - value.numel())])
    packed = q.quantize_fp8(value, block, signed) if precision == "fp8" else q.quantize(value, bits, signed, block)
    codes, scale = state.get(f"{name}_codes"), state.get(f"{name}_scale")
    if codes is not None and codes.shape == packed.codes.shape and scale is not None:
        codes.copy_(packed.codes)  # in place: the storage a checkpoint or a view refers to stays
        scale.copy_(packed.scale)
    else:
        state[f"{name}_codes"], state[f"{name}_scale"] = packed.codes, packed.scale


def _load(state: dict[str, Any], name: str, shape: torch.Size, precision: str, signed: bool) -> torch.Tensor:
    packed = q.Quantized(state[f"{name}_codes"], state[f"{name}_scale"], shape, FORMATS[precision][0], signed)
    return q.dequantize(packed)


def quantized_state(state: dict[str, Any], p: torch.Tensor, precision: str, capacity: int = 0) -> dict[str, Any]:
    """``state`` with quantized moments (in place): zeros for a new one; fp32 moments (a checkpoint of
    an fp32-state run) quantized, their tensors dropped. ``capacity``: values to make room for (at least
    ``p``'s; under FSDP2 the largest shard's, so every rank's codes have one length)."""
    bits, block = FORMATS[precision]
    capacity = max(capacity, p.numel())
    if not is_quantized(state):
        for name, signed in _MOMENTS:
            moment = state.pop(name, None)
            if moment is not None:
                _store(state, name, moment.float(), precision, signed, capacity)
                continue
            # zeros as torchao starts them: every code 0 and every scale 0 (a zero scale makes any entry 0)
            blocks = -(-capacity // block)
            dtype = q.FP8 if precision == "fp8" else torch.uint8
            state[f"{name}_codes"] = torch.zeros(blocks * block * bits // 8, dtype=dtype, device=p.device)
            state[f"{name}_scale"] = torch.zeros(blocks, device=p.device)
        state.setdefault("step", torch.tensor(0.0))
    return state


def _saved_precision(state: dict[str, Any]) -> str:
    """The precision the moments were stored at: fp8 codes are e4m3; 8 bits hold a block's 256 values in
    256 bytes, 4 bits its 128 in 64."""
    codes = state["exp_avg_codes"]
    if codes.dtype == q.FP8:
        return "fp8"
    return "8bit" if codes.numel() // state["exp_avg_scale"].numel() == FORMATS["8bit"][1] else "4bit"


@torch.no_grad()
def adam_step(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
              decoupled: bool, precision: str, capacity: int = 0,
              write: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:  # fmt: skip
    """One Adam (``decoupled=False``) or AdamW step of ``p`` (in place) with quantized moments in ``state``.

    ``p`` and ``grad`` are whole tensors or this rank's shards of them (``capacity``: see :func:`quantized_state`).
    ``write(p, new)`` stores the fp32 result in ``p`` (default ``p.copy_(new)``: rounded to nearest).
    """
    capacity = max(capacity, p.numel())
    quantized_state(state, p, precision, capacity)
    saved = _saved_precision(state)  # a checkpoint of another precision is read as written, written as this run's
    state["step"] += 1
    step = state["step"]
    lr = torch.tensor(float(group["lr"]), dtype=torch.float32)
    beta1, beta2 = (float(b) for b in group["betas"])
    weight_decay, eps = float(group["weight_decay"]), float(group["eps"])
    p32, g32 = p.float(), grad.float()
    if decoupled:
        p32 = p32 - lr * weight_decay * p32
    else:
        g32 = g32 + weight_decay * p32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    m = _load(state, "exp_avg", p.shape, saved, True).lerp(g32, 1 - beta1)
    v = _load(state, "exp_avg_sq", p.shape, saved, False).lerp(g32.square(), 1 - beta2)
    _store(state, "exp_avg", m, precision, True, capacity)
    _store(state, "exp_avg_sq", v, precision, False, capacity)
    denom = (v.sqrt() / bias_correction2.sqrt()) + eps
    new = p32 - lr * (m / bias_correction1) / denom
    if write is None:
        p.copy_(new)
    else:
        write(p, new)


def fp32_state(state: dict[str, Any], shape: torch.Size) -> dict[str, Any]:
    """``state`` with its moments back in fp32 (in place), as torch's Adam keeps them."""
    if is_quantized(state):
        saved = _saved_precision(state)
        for name, signed in _MOMENTS:
            state[name] = _load(state, name, shape, saved, signed)
            del state[f"{name}_codes"], state[f"{name}_scale"]
    return state
