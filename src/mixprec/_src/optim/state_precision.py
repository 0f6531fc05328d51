"""The precisions an optimizer's state can be kept at: :class:`StatePrecision`."""

from __future__ import annotations

from mixprec._src.dtypes import NamedEnum

__all__ = ["StatePrecision"]

#: (bits, block size) of the quantized precisions: torchao's formats (fp8: e4m3 values, ``AdamWFp8``'s).
_FORMATS = {"8bit": (8, 256), "4bit": (4, 128), "fp8": (8, 256)}


class StatePrecision(NamedEnum):
    """What ``PrepareConfig.optimizer_state`` takes: Adam's and AdamW's moments and SGD's momentum kept as the
    level keeps them (``"fp32"``), as bf16 tensors (stochastically rounded), or block-wise quantized
    (``"8bit"``, ``"4bit"``, ``"fp8"``: torchao's formats). A member equals its name (``StatePrecision.BF16 ==
    "bf16"``); ``from_name`` parses one and its error lists them."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "8bit"
    INT4 = "4bit"
    FP8 = "fp8"

    @property
    def own(self) -> bool:
        """Whether mixprec's step keeps this state (every precision but ``fp32``, which the optimizer keeps)."""
        return self is not StatePrecision.FP32

    @property
    def quantized(self) -> bool:
        """Whether the state is kept as codes and block scales (8bit, 4bit, fp8)."""
        return self.value in _FORMATS

    @property
    def bits(self) -> int:
        """Bits a value: of the codes where quantized, else of the tensor (32 or 16)."""
        return _FORMATS[self.value][0] if self.quantized else (16 if self is StatePrecision.BF16 else 32)

    @property
    def block(self) -> int:
        """Values a scale covers (quantized precisions; 0 for the others, which have no scales)."""
        return _FORMATS[self.value][1] if self.quantized else 0

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "optimizer_state", "optimizer states"
