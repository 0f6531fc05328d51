"""fp8 linears: the recipe and scaling choices, and what :func:`fp8_layers` reports of a prepared model.

``mixprec.prepare(model, optimizer, level, fp8=Fp8Config(...))`` converts the model's linears; the
config types are also at the top level (``mixprec.Fp8Config``).
"""

from mixprec._src.fp8.config import AmaxAlgo, Fp8Config, Fp8Recipe
from mixprec._src.fp8.conversion import Fp8Layers, fp8_layers

__all__ = ["AmaxAlgo", "Fp8Config", "Fp8Layers", "Fp8Recipe", "fp8_layers"]
