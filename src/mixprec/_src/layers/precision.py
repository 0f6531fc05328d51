"""Per-layer precision: one GEMM layer computes in a precision of its own.

The layers are ``gemms.sites.gemm_layers``': linears (and their forwarding subclasses),
transformers' ``Conv1D``, an ``nn.MultiheadAttention``'s packed in-projection (``<attention>.in_proj``)
and its ``out_proj`` (the attention routed so both run as modules), and convolutions.

``set_layer_precision(model, "blocks.0.fc1", "fp32")`` is what a tuned recipe's per-layer plan
(:meth:`mixprec.Recipe.apply`) and the training guard (:class:`mixprec.Guard`) call. A layer's
precision is one of :data:`PRECISIONS`:

* ``"nvfp4"``, ``"mxfp8"``: the layer (of a linear kind) computes in that block-scaled format (the fp8 recipe
  of that name, emulated: ``fp8/block_gemm.py``);
* ``"fp8-<recipe>"``: the layer (of a linear kind) computes in fp8 with that recipe (``fp8_conversion.set_layer``);
* ``"bf16"``, ``"fp16"``, ``"fp32"``: its GEMM runs in that dtype whatever the region around it
  says (input, weight and bias cast to it, autocast off inside); the output stays in that dtype
  inside an autocast region (the next op casts it, as autocast does) and is cast back to the
  input's dtype outside one, so an fp32 model with one bf16 layer runs.

The parameters, their names and the state dict are the layer's own (a dtype override adds
nothing; fp8 adds what the fp8 recipe adds). Nothing here syncs with the device.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec._src import bound_forward
from mixprec._src.amp import compiled_backward
from mixprec._src.dtypes import NamedEnum, parse_dtype, short_name
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8.config import BLOCK_RECIPES, Fp8Config, Fp8Recipe
from mixprec._src.gemms import kinds, sites

__all__ = [
    "DELAYED_PER_LAYER",
    "FP8_PREFIX",
    "LayerPrecision",
    "PRECISIONS",
    "fp8_recipe_of",
    "is_layer",
    "layer_of",
    "layer_precision",
    "parse_precision",
    "set_layer_precision",
]

FP8_PREFIX = "fp8-"
_DTYPE = "_mixprec_layer_dtype"  # a dtype override, in the layer's __dict__


class LayerPrecision(NamedEnum):
    """What one GEMM layer computes in: a block-scaled format (``"nvfp4"``, ``"mxfp8"``), an fp8 recipe
    (``"fp8-<recipe>"``) or a dtype; least precise first.

    A member is equal to its name (``LayerPrecision.BF16``, ``"bf16"``); :meth:`from_name` also takes dtypes and
    their names (``torch.bfloat16``, ``"bfloat16"``)."""

    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"
    FP8_DELAYED = "fp8-delayed"
    FP8_TENSORWISE = "fp8-tensorwise"
    FP8_ROWWISE = "fp8-rowwise"
    FP8_ROWWISE_WITH_GW_HP = "fp8-rowwise_with_gw_hp"
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"

    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        """The fp8 recipe of an ``fp8-<recipe>`` or block-scaled precision, else ``None``."""
        if self.value.startswith(FP8_PREFIX):
            return Fp8Recipe(self.value[len(FP8_PREFIX) :])
        return Fp8Recipe(self.value) if self.value in _BLOCK else None

    @property
    def block(self) -> bool:
        """A block-scaled format (emulated: its GEMMs' time is not the hardware's)."""
        return self.value in _BLOCK

    @classmethod
    def of_recipe(cls, recipe: Fp8Recipe) -> LayerPrecision:
        """The layer precision of an fp8 recipe: ``"nvfp4"`` for nvfp4, ``"fp8-tensorwise"`` for tensorwise."""
        return cls(recipe.value if recipe.value in _BLOCK else FP8_PREFIX + recipe.value)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of a dtype precision, else ``None`` (fp8)."""
        return None if self.fp8_recipe is not None else parse_dtype(self.value)

    @property
    def rung(self) -> int:
        """Its rung on the guard's ladder: 0 nvfp4, 1 mxfp8, 2 fp8, 3 the 16-bit dtypes, 4 fp32."""
        if self.block:
            return 0 if self is LayerPrecision.NVFP4 else 1
        return 2 if self.fp8_recipe is not None else 4 if self is LayerPrecision.FP32 else 3

    @classmethod
    def from_name(cls, name: str | torch.dtype) -> LayerPrecision:  # type: ignore[override]
        """``"fp8-tensorwise"``, ``"bf16"``, ``torch.bfloat16``, ``"bfloat16"`` -> the member.

        Raises:
            ValueError: not a precision; the message lists them.
        """
        if isinstance(name, cls):
            return name
        if isinstance(name, str) and name in _BLOCK:
            return cls(name)
        if isinstance(name, str) and name.startswith(FP8_PREFIX):
            return cls.of_recipe(Fp8Recipe.from_name(name[len(FP8_PREFIX) :]))
        try:
            return cls(short_name(parse_dtype(name, what="layer precision")))
        except (TypeError, ValueError):
            raise ValueError(f"unknown layer precision {name!r}; valid: {', '.join(cls)}") from None


_BLOCK = frozenset(r.value for r in BLOCK_RECIPES)

#: Every precision a layer can be given, from the least precise to the most.
PRECISIONS = tuple(LayerPrecision)


def parse_precision(value: str | torch.dtype) -> LayerPrecision:
    """A layer precision's member: ``"fp8-tensorwise"``, ``"bf16"``; dtypes and their names accepted.

    Raises:
        ValueError: not a precision; the message lists them.
    """
    return LayerPrecision.from_name(value)


def fp8_recipe_of(precision: str) -> Fp8Recipe | None:
    """The fp8 recipe of ``"fp8-<recipe>"``, else ``None``."""
    return LayerPrecision.from_name(precision).fp8_recipe


def is_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a GEMM layer of a kind ``gemms.kinds`` knows (an attention's ``out_proj`` is
    one once its attention is routed: ask ``gemms.sites.gemm_layers``)."""
    return kinds.kind_of(module) is not None


def layer_precision(model: nn.Module, name: str) -> LayerPrecision | None:
    """The precision set on layer ``name`` (an fp8 recipe or a dtype override), or ``None``: the region's.

    ``name`` as ``mixprec.gemm_reach`` and the per-layer plan name layers (``<attention>.in_proj`` routes the
    attention, as :func:`set_layer_precision` does)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = layer_of(model, name)
    scaling = fp8_conversion.scaling_of(module)
    if scaling is not None:
        return LayerPrecision.of_recipe(scaling.config.recipe)
    dtype = module.__dict__.get(_DTYPE)
    return None if dtype is None else LayerPrecision.from_name(dtype)


def set_layer_precision(model: nn.Module, name: str, precision: str | torch.dtype | None) -> None:
    """Make layer ``name`` of ``model`` compute in ``precision`` (in place; ``None``: as the region says).

    Raises:
        ValueError: not a GEMM layer, an unknown precision, fp8 on a layer fp8 cannot convert (a
            convolution, a subclass with its own forward, features not multiples of 16).
    """
    module = layer_of(model, name)
    canonical = None if precision is None else parse_precision(precision)
    recipe = None if canonical is None else fp8_recipe_of(canonical)
    if recipe is Fp8Recipe.DELAYED:
        raise ValueError(DELAYED_PER_LAYER)
    if recipe is not None:
        module.__dict__.pop(_DTYPE, None)
        if module.__dict__.get("forward") is not None and not fp8_conversion.is_converted(module):
            module.__dict__.pop("forward")
        fp8_conversion.set_layer(model, name, Fp8Config(recipe))
        return
    if fp8_conversion.is_converted(module):
        fp8_conversion.set_layer(model, name, None)
    if canonical is None:
        module.__dict__.pop(_DTYPE, None)
        module.__dict__.pop("forward", None)
        return
    module.__dict__[_DTYPE] = canonical.dtype
    bound_forward.bind(module, _dtype_forward)
    sites.settle(model)


#: Why one layer cannot be given delayed scaling on its own.
DELAYED_PER_LAYER = (
    "fp8-delayed keeps an amax history that prepare's step hook advances: a whole-model choice "
    "(mixprec.prepare(..., fp8='delayed'), Recipe(fp8='delayed')); one layer takes a dynamic "
    "recipe (fp8-tensorwise, fp8-rowwise)"
)


def layer_of(model: nn.Module, name: str) -> nn.Module:
    """The GEMM layer called ``name`` in ``model`` (its attentions routed first, so ``<attention>.in_proj``
    and ``<attention>.out_proj`` name layers).

    Raises:
        ValueError: no such module, or not a layer a precision can be given to (with why).
    """
    found = {n: m for n, m, _ in sites.gemm_layers(model)}
    if name in found:
        return found[name]
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"the model has no module {name!r} (names as model.named_modules() gives them)") from None
    why = dict(sites.left_out(model)).get(name) or (
        f"a {type(module).__name__} is not a GEMM layer; per-layer precision applies to linears (and their "
        "subclasses that keep nn.Linear's forward), transformers' Conv1D, nn.MultiheadAttention's in_proj and "
        "out_proj, and convolutions"
    )
    raise ValueError(f"{name!r}: {why}")


def _dtype_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The forward of a layer with a dtype override (bound to it by :func:`set_layer_precision`)."""
    dtype: torch.dtype = self.__dict__[_DTYPE]
    device_type = input.device.type
    region = torch.is_autocast_enabled(device_type)
    compiled_backward.backward_like_eager()  # its backward in its dtype too when compiled
    weight, bias = kinds.weight_of(self), kinds.bias_of(self)
    with torch.autocast(device_type, enabled=False):  # the GEMM's dtype is the layer's, not the region's
        x, w = input.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        out = kinds.compute(self, x, w, b)
    return out if region or not input.is_floating_point() else out.to(input.dtype)
