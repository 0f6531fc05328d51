"""Which linears train in fp8 and how they are scaled, as one value: :class:`Fp8Config`.

``PrepareConfig(fp8="tensorwise")`` or ``PrepareConfig(fp8=Fp8Config("delayed", history_len=16))``;
the recipes are torchao.float8's three (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``),
Transformer Engine's delayed scaling (``delayed``) and the block-scaled ``mxfp8`` and ``nvfp4``
(``fp8/block_formats.py``), each described per GEMM operand (:data:`RECIPE_OPERANDS`; a block
recipe's from its options, :attr:`Fp8Config.operands`), which is all the layer (``fp8/linear.py``) reads.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import torch
from torch import nn

from mixprec._src.dtypes import NamedEnum
from mixprec._src.fp8.block_formats import ScaleMode
from mixprec._src.fp8.block_gemm import MX, NV, BlockScaling
from mixprec._src.policy.rules import ModuleFilter

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPE_OPERANDS",
    "AmaxAlgo",
    "BLOCK_RECIPES",
    "as_fp8_config",
    "Fp8Config",
    "Fp8Recipe",
    "is_plain_linear",
    "Operand",
    "RecipeOperands",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


class Fp8Recipe(NamedEnum):
    """How an fp8 linear scales its GEMM operands."""

    #: One dynamic scale per tensor (torchao's default): e4m3 input and weight, e5m2 gradients.
    TENSORWISE = "tensorwise"
    #: One dynamic scale per row of each GEMM operand, power-of-two scales, e4m3 everywhere.
    ROWWISE = "rowwise"
    #: Rowwise forward and input gradient; the weight gradient's GEMM in high precision.
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    #: Transformer Engine's default: per-tensor scales from the amax history of past steps.
    DELAYED = "delayed"
    #: MXFP8: e4m3 everywhere, a power-of-two (e8m0) scale every 32 values along each GEMM's reduction dim.
    MXFP8 = "mxfp8"
    #: NVFP4 (arXiv 2509.25149): e2m1 in blocks of 16 with e4m3 scales under a tensor scale; 16x16 weight tiles,
    #: a random Hadamard transform before the weight-gradient GEMM, stochastically rounded gradients.
    NVFP4 = "nvfp4"

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "fp8 recipe", "fp8 recipes"


class AmaxAlgo(NamedEnum):
    """How delayed scaling turns an amax history into the amax a scale is made from."""

    MAX = "max"  # the largest amax of the history (Transformer Engine's default)
    MOST_RECENT = "most_recent"  # the last step's amax

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "amax algorithm", "amax algorithms"


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one GEMM operand is cast: its fp8 dtype (``None``: kept in high precision, that GEMM
    runs unquantized) and whether it has one scale per row of the GEMM operand (over the
    reduction axis) rather than one for the tensor, or one per block of a row (``block``)."""

    dtype: torch.dtype | None
    rowwise: bool = False
    block: BlockScaling | None = None


@dataclasses.dataclass(frozen=True)
class RecipeOperands:
    """The six operands of a linear's three GEMMs (output, input gradient, weight gradient)."""

    input: Operand
    weight: Operand
    grad_output: Operand  # in the input-gradient GEMM
    weight_for_grad_input: Operand
    grad_output_for_grad_weight: Operand
    input_for_grad_weight: Operand
    power_of_two_scales: bool = False  # rowwise: exact scale products, as torchao rounds them
    rotate_grad_weight: bool = False  # the weight gradient's operands rotated by a random Hadamard transform


_T4, _T5, _R4, _HP = Operand(E4M3), Operand(E5M2), Operand(E4M3, rowwise=True), Operand(None)

#: Each recipe, operand by operand (torchao's ``Float8LinearConfig.from_recipe_name``; TE's HYBRID format).
RECIPE_OPERANDS: dict[Fp8Recipe, RecipeOperands] = {
    Fp8Recipe.TENSORWISE: RecipeOperands(_T4, _T4, _T5, _T4, _T5, _T4),
    Fp8Recipe.ROWWISE: RecipeOperands(_R4, _R4, _R4, _R4, _R4, _R4, power_of_two_scales=True),
    Fp8Recipe.ROWWISE_WITH_GW_HP: RecipeOperands(_R4, _R4, _R4, _T4, _HP, _HP, power_of_two_scales=True),
    Fp8Recipe.DELAYED: RecipeOperands(_T4, _T4, _T5, _T4, _T5, _T4),
}

#: The block-scaled recipes (their operands are built from the config's options).
BLOCK_RECIPES = frozenset({Fp8Recipe.MXFP8, Fp8Recipe.NVFP4})
_FP4 = torch.float4_e2m1fn_x2


def _block_operands(config: Fp8Config) -> RecipeOperands:
    """A block recipe's six operands, as its options say."""
    if config.recipe is Fp8Recipe.MXFP8:
        mx = Operand(E4M3, block=BlockScaling(MX, E4M3, config.scale_mode))
        return RecipeOperands(mx, mx, mx, mx, mx, mx)
    plain = Operand(_FP4, block=BlockScaling(NV))
    weight = Operand(_FP4, block=BlockScaling(NV, tile=config.tiles))
    grad = Operand(_FP4, block=BlockScaling(NV, stochastic=config.stochastic_grads))
    return RecipeOperands(plain, weight, grad, weight, grad, plain, rotate_grad_weight=config.hadamard)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """Which ``nn.Linear`` layers :func:`mixprec.prepare` turns into fp8 layers, and their recipe.

    A layer is converted when it is an ``nn.Linear``, matches ``names`` (qualified-name globs; all
    by default) and ``filter`` (if given), and is not the model's output head (the last linear
    registered, kept unless ``convert_head``); layers whose features are not multiples of 16 (what
    fp8 GEMMs need on CUDA) and layers kept in fp32 by the prepare config are left out. What was
    left out, and why, is listed on the prepared model (``mixprec.fp8_layers``).

    Attributes:
        recipe: ``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` or ``"delayed"``.
        names: qualified-name globs of the linears to convert, or of modules holding them (as
            ``keep_names``): ``"blocks.*.mlp"``, ``"blocks.0"``.
        filter: ``(module, qualified_name) -> bool``, as torchao's ``module_filter_fn``.
        convert_head: convert the last linear too (the output head; fp8 there costs accuracy).
        history_len: delayed scaling: steps of amax history per tensor (TE's default 1024).
        margin: delayed scaling: scales are divided by ``2**margin`` (headroom for growth).
        amax_algo: delayed scaling: ``"max"`` of the history or the ``"most_recent"`` amax.
        all_gather: under FSDP2, all-gather the converted layers' weights in fp8 (tensorwise and
            delayed recipes: one scale per weight).
        scale_mode: mxfp8: how a block's power-of-two scale is picked, ``"rceil"`` (cuBLAS's: nothing
            clamps) or ``"floor"`` (the OCP spec's).
        tiles: nvfp4: weights scaled in 16x16 tiles (the weight and its transpose quantize alike).
        hadamard: nvfp4: a random 16x16 Hadamard transform on both weight-gradient GEMM operands.
        stochastic_grads: nvfp4: output gradients rounded stochastically.
        keep_last: nvfp4: the fraction of the selected layers, the last ones, left in high precision
            (at least one while it is above 0); 0.15 unless given.

    Raises:
        ValueError: an unknown recipe or amax algorithm, a history shorter than 1, a negative margin,
            delayed-scaling options with another recipe.
        TypeError: names that are not strings, a filter that is not callable, a non-bool convert_head.
    """

    recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    names: tuple[str, ...] = ("*",)
    filter: ModuleFilter | None = None
    convert_head: bool = False
    history_len: int = 1024
    margin: int = 0
    amax_algo: AmaxAlgo = AmaxAlgo.MAX
    all_gather: bool = False
    scale_mode: ScaleMode = ScaleMode.RCEIL
    tiles: bool = True
    hadamard: bool = True
    stochastic_grads: bool = True
    keep_last: float | None = None

    def __post_init__(self) -> None:
        names: Any = self.names
        object.__setattr__(self, "recipe", Fp8Recipe.from_name(self.recipe))
        object.__setattr__(self, "amax_algo", AmaxAlgo.from_name(self.amax_algo))
        object.__setattr__(self, "scale_mode", ScaleMode.from_name(self.scale_mode))
        names = (names,) if isinstance(names, str) else names
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"fp8 names are qualified-name globs (a string or a tuple of them), got {names!r}")
        object.__setattr__(self, "names", tuple(names))
        for flag in ("convert_head", "all_gather", "tiles", "hadamard", "stochastic_grads"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"fp8 {flag} is True or False, got {getattr(self, flag)!r}")
        if self.all_gather and (self.operands.weight.rowwise or self.block):
            per = "block" if self.block else "row"
            raise ValueError(
                f"all_gather=True casts each weight shard with one scale per weight; recipe "
                f"{self.recipe.value!r} scales weights per {per}: use tensorwise or delayed"
            )
        keep = self.keep_last
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 <= keep < 1):
            raise ValueError(f"fp8 keep_last is a fraction of the layers in [0, 1), got {keep!r}")
        if self.recipe is not Fp8Recipe.MXFP8 and self.scale_mode is not ScaleMode.RCEIL:
            raise ValueError(f"scale_mode picks mxfp8's block scales; recipe {self.recipe.value!r} has none")
        nvfp4_defaults = (True, True, True, None)
        if (
            self.recipe is not Fp8Recipe.NVFP4
            and (
                self.tiles,
                self.hadamard,
                self.stochastic_grads,
                self.keep_last,
            )
            != nvfp4_defaults
        ):
            raise ValueError(
                f"tiles, hadamard, stochastic_grads and keep_last are the nvfp4 recipe's parts; recipe "
                f"{self.recipe.value!r} has none of them: use recipe 'nvfp4' with them"
            )
        if self.filter is not None and not callable(self.filter):
            raise TypeError("fp8 filter must be a callable (module, qualified_name) -> bool")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"fp8 history_len must be a positive int, got {self.history_len!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"fp8 margin must be a non-negative int, got {self.margin!r}")
        defaults = (1024, 0, AmaxAlgo.MAX)
        if not self.delayed and (self.history_len, self.margin, self.amax_algo) != defaults:
            raise ValueError(
                f"history_len, margin and amax_algo set delayed scaling; recipe {self.recipe.value!r} "
                "scales by each tensor's current amax: use recipe 'delayed' with them"
            )

    @property
    def operands(self) -> RecipeOperands:
        """The recipe, operand by operand."""
        return _block_operands(self) if self.block else RECIPE_OPERANDS[self.recipe]

    @property
    def kept_fraction(self) -> float:
        """The fraction of the selected layers, the last ones, the recipe leaves in high precision."""
        if self.recipe is not Fp8Recipe.NVFP4:
            return 0.0
        return 0.15 if self.keep_last is None else float(self.keep_last)

    @property
    def block(self) -> bool:
        """A block-scaled recipe (``mxfp8``, ``nvfp4``)."""
        return self.recipe in BLOCK_RECIPES

    @property
    def delayed(self) -> bool:
        return self.recipe is Fp8Recipe.DELAYED

    def selects(self, module: nn.Module, name: str) -> bool:
        """Whether ``module`` (called ``name``) is asked for by ``names`` and ``filter``."""
        parts = name.split(".")
        holders = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # the layer and the modules holding it
        if not any(fnmatch.fnmatchcase(held, pattern) for held in holders for pattern in self.names):
            return False
        return self.filter is None or bool(self.filter(module, name))

    def __str__(self) -> str:
        """One line, e.g. ``fp8 delayed(history=16, margin=0, max)``."""
        text = f"fp8 {self.recipe.value}"
        if self.delayed:
            text += f"(history={self.history_len}, margin={self.margin}, {self.amax_algo.value})"
        if self.recipe is Fp8Recipe.MXFP8:
            text += f"({self.scale_mode.value})"
        if self.recipe is Fp8Recipe.NVFP4:
            parts = [n for n in ("tiles", "hadamard", "stochastic_grads") if getattr(self, n)]
            text += f"({', '.join([*parts, f'keep_last={self.kept_fraction:g}'])})"
        if self.names != ("*",):
            text += f" names={'+'.join(self.names)}"
        if self.filter is not None:
            text += f" filter={getattr(self.filter, '__name__', 'filter')}"
        return text + (" +head" if self.convert_head else "") + (" +all_gather" if self.all_gather else "")


def is_plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself, or one ``fully_shard`` made its own unit (class ``FSDPLinear``); no subclass."""
    return type(module) is nn.Linear or _is_sharded_linear(module)


def _is_sharded_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` that ``fully_shard`` turned into its own unit (class ``FSDPLinear``)."""
    mro = type(module).__mro__
    return nn.Linear in mro and mro[0].__name__ == f"FSDP{nn.Linear.__name__}"


def as_fp8_config(value: Fp8Config | Fp8Recipe | str | None) -> Fp8Config | None:
    """A recipe name, a config or ``None``, as a config."""
    if value is None or isinstance(value, Fp8Config):
        return value
    if isinstance(value, str):
        return Fp8Config(Fp8Recipe.from_name(value))
    raise TypeError(f"fp8 must be a recipe name, an Fp8Config or None, got {type(value).__name__}")
