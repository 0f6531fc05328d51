"""What :func:`mixprec.tune` measured: each candidate (:class:`Measurement`), each layer of a per-layer plan
(:class:`LayerChoice`) and what :meth:`mixprec.Recipe.apply` returns (:class:`Applied`), beside the recipe and
its tolerance (also at the top level); and :func:`plan_layers`, the per-layer plan on its own (block-scaled
formats included).
"""

from mixprec._src.layers.choice import LayerChoice
from mixprec._src.tune.layer_plans import plan_layers
from mixprec._src.tune.measurement import Measurement, Tolerance
from mixprec._src.tune.recipe import Applied, Recipe
from mixprec._src.tune.search import tune

__all__ = ["Applied", "LayerChoice", "Measurement", "Recipe", "Tolerance", "plan_layers", "tune"]
