"""An optimizer's state tensors stored block-wise quantized: formats, store, load, the precision saved.

A state tensor ``name`` (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) is kept as two tensors
of the optimizer's state, ``<name>_codes`` and ``<name>_scale`` (``optim.quantize``); second
moments (``exp_avg_sq``) are unsigned, the rest signed. Nothing here syncs with the device.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.optim import quantize as q
from mixprec._src.optim.state_precision import StatePrecision

__all__ = [
    "BF16",
    "FORMATS",
    "MIN_NUMEL",
    "STATE_PRECISIONS",
    "conform",
    "fp32_state",
    "is_quantized",
    "load",
    "saved_precision",
    "signed",
    "store",
    "zeros",
]

#: Quantized state precision -> (bits, block size): torchao's formats (fp8: e4m3 values, ``AdamWFp8``'s).
FORMATS: dict[str, tuple[int, int]] = {p: (p.bits, p.block) for p in StatePrecision if p.quantized}
#: bf16 state: the moments as bf16 tensors, stochastically rounded (``step.bf16_state``)
BF16 = StatePrecision.BF16
#: What ``PrepareConfig.optimizer_state`` takes: the state as the level keeps it, in bf16, or quantized.
STATE_PRECISIONS = tuple(StatePrecision)
#: Parameters with fewer values keep their state as the level keeps it (torchao's threshold).
MIN_NUMEL = 4096
_UNSIGNED = ("exp_avg_sq",)


def signed(name: str) -> bool:
    """Whether state tensor ``name`` takes negative values (a second moment does not)."""
    return name not in _UNSIGNED


def is_quantized(state: dict[str, Any]) -> bool:
    return any(key.endswith("_codes") for key in state)


def store(state: dict[str, Any], name: str, value: torch.Tensor, precision: str, capacity: int) -> None:
    """Keep ``value`` as ``name``'s codes and scales (in place where they exist), room made for ``capacity``
    values (under FSDP2 the largest shard's, so every rank's codes have one length)."""
    bits, block = FORMATS[precision]
    if capacity > value.numel():  # zeros up to the room every rank's shard of this parameter takes
        value = torch.cat([value.reshape(-1), value.new_zeros(capacity - value.numel())])
    sign = signed(name)
    packed = (
        q.quantize_fp8(value, block, sign) if precision == StatePrecision.FP8 else q.quantize(value, bits, sign, block)
    )
    codes, scale = state.get(f"{name}_codes"), state.get(f"{name}_scale")
    if codes is not None and codes.shape == packed.codes.shape and scale is not None:
        codes.copy_(packed.codes)  # in place: the storage a checkpoint or a view refers to stays
        scale.copy_(packed.scale)
    else:
        state[f"{name}_codes"], state[f"{name}_scale"] = packed.codes, packed.scale


def zeros(state: dict[str, Any], name: str, device: torch.device, precision: str, capacity: int) -> None:
    """``name`` as torchao starts a state: every code 0 and every scale 0 (a zero scale makes any entry 0)."""
    dtype, codes_len, blocks = _layout(precision, capacity)
    state[f"{name}_codes"] = torch.zeros(codes_len, dtype=dtype, device=device)
    state[f"{name}_scale"] = torch.zeros(blocks, device=device)


def saved_precision(state: dict[str, Any], name: str) -> str:
    """The precision ``name`` was stored at: fp8 codes are e4m3; 8 bits hold a block's 256 values in 256
    bytes, 4 bits its 128 in 64 (a checkpoint of another precision is read as it was written).

    Raises:
        ValueError: codes and scales of no format (a checkpoint of something else).
    """
    codes, scale = state[f"{name}_codes"], state.get(f"{name}_scale")
    if scale is None or scale.numel() == 0 or not scale.is_floating_point():
        raise ValueError(f"optimizer state {name!r} has codes but no scales: not a state mixprec quantized")
    ratio, rest = divmod(codes.numel(), scale.numel())
    fp8, int8, int4 = StatePrecision.FP8, StatePrecision.INT8, StatePrecision.INT4
    if codes.dtype == q.FP8 and not rest and ratio == fp8.block:
        return fp8
    if codes.dtype == torch.uint8 and not rest and ratio == int8.block:
        return int8
    if codes.dtype == torch.uint8 and not rest and ratio == int4.block * int4.bits // 8:
        return int4
    raise ValueError(
        f"optimizer state {name!r}: {codes.numel()} codes of {codes.dtype} for {scale.numel()} scales "
        "are none of the formats (8bit, 4bit, fp8): not a state mixprec quantized"
    )


def _layout(precision: str, capacity: int) -> tuple[torch.dtype, int, int]:
    """What ``store`` makes for ``capacity`` values at ``precision``: the codes' dtype and length, the scales'."""
    bits, block = FORMATS[precision]
    blocks = -(-capacity // block)
    return (q.FP8 if precision == StatePrecision.FP8 else torch.uint8), blocks * block * bits // 8, blocks


def conform(state: dict[str, Any], precision: str, numel: int, capacity: int) -> None:
    """Every quantized tensor of ``state`` in ``precision``'s layout for ``capacity`` values (in place; ``numel``:
    the parameter's, or under FSDP2 the whole parameter's, of which a shard needs at most ``capacity``).

    One stored at another precision or for another room (a checkpoint of another run: 4-bit codes in an 8-bit
    run, another sharding's padding) is dequantized and stored again, so a kernel reads codes and scales of the
    dtype and length it expects; one already in the layout is left as it is (no copy). Host-side checks.

    Raises:
        ValueError: a tensor of no format, or holding fewer values than the parameter's ``numel``.
    """
    dtype, codes_len, scales_len = _layout(precision, capacity)
    for key in [k for k in state if k.endswith("_codes")]:
        name = key.removesuffix("_codes")
        codes, scale = state[key], state.get(f"{name}_scale")
        if (
            codes.dtype is dtype
            and codes.numel() == codes_len
            and scale is not None
            and scale.numel() == scales_len
            and scale.dtype is torch.float32
            and codes.is_contiguous()
            and scale.is_contiguous()
        ):
            continue
        saved = saved_precision(state, name)  # raises where the scales are missing
        held = min(state[f"{name}_scale"].numel() * FORMATS[saved][1], capacity)
        if held < min(numel, capacity):
            raise ValueError(
                f"optimizer state {name!r} holds {held} values and its parameter (or this rank's shard "
                f"of it) {min(numel, capacity)}: a checkpoint of another model or sharding"
            )
        values = load(state, name, torch.Size([held]))
        del state[key], state[f"{name}_scale"]
        store(state, name, values, precision, capacity)


def load(state: dict[str, Any], name: str, shape: torch.Size) -> torch.Tensor:
    """``name``'s values in fp32, shaped ``shape`` (the parameter's, or this rank's shard's)."""
    bits = FORMATS[saved_precision(state, name)][0]
    return q.dequantize(q.Quantized(state[f"{name}_codes"], state[f"{name}_scale"], shape, bits, signed(name)))


def fp32_state(state: dict[str, Any], shape: torch.Size) -> dict[str, Any]:
    """``state`` with every quantized tensor back in fp32 (in place), as torch's optimizers keep them."""
    for key in [k for k in state if k.endswith("_codes")]:
        name = key.removesuffix("_codes")
        state[name] = load(state, name, shape)
        del state[f"{name}_codes"], state[f"{name}_scale"]
    return state
