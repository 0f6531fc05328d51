"""Which modules are kept in fp32 (or another dtype): :class:`ModuleRule`, the norm layers by type and by name.

A rule matches modules by type (``NORM_TYPES`` by default) or by qualified-name glob; with every one of the
norm types it also matches the norms of libraries mixprec does not import, by class name
(:func:`named_like_a_norm`). :func:`rule_items` writes a rule as a policy's string form does.
Host-side checks only: nothing here touches a tensor.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable

import torch
from torch import nn

from mixprec._src.dtypes import parse_dtype, short_name
from mixprec._src.errors import PolicyError

__all__ = ["NORM_TYPES", "ModuleFilter", "ModuleRule", "named_like_a_norm", "rule_items"]


#: Norm layers, the usual modules to keep in fp32. A rule with all of them (``norm`` in a policy's string
#: form, prepare's default) also matches the norms of libraries mixprec does not import, by class name
#: (:func:`named_like_a_norm`).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)

# Hugging Face's LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, GemmaRMSNorm, T5LayerNorm, MambaRMSNormGated;
# timm's RmsNorm, RmsNorm2d, LayerNorm2d, BatchNormAct2d; apex's FusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm.
_NORM_NAME = re.compile(r"(rms|layer|group|batch|instance)_?norm(act)?(\d*d)?(gated)?$", re.IGNORECASE)


_NORM_CLASSES: dict[type, bool] = {}


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]  # Dynamo cannot trace re
def _norm_class(cls: type) -> bool:
    found = _NORM_CLASSES.get(cls)
    if found is None:
        mro = (k for k in cls.__mro__ if k is not nn.Module and k is not object)
        found = _NORM_CLASSES[cls] = any(_NORM_NAME.search(k.__name__) for k in mro)
    return found


def named_like_a_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm layer of a library mixprec does not import: its class (or a base) is named
    like one (``...RMSNorm``, ``...LayerNorm``, ``RmsNorm2d``, ``...GroupNorm``, ``...BatchNormAct2d``, a
    ``...Gated`` variant) and no module inside it holds parameters (a block named so, with projections
    inside such as an adaptive norm, is not one)."""
    if not _norm_class(type(module)):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


#: ``(module, qualified_name) -> bool``, as torchao's ``module_filter_fn``.
ModuleFilter = Callable[[nn.Module, str], bool]


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """Run matching modules in ``dtype``, with floating inputs cast at the module boundary.

    A module matches when it is an instance of one of ``types`` or its qualified
    name (as in ``model.named_modules()``) matches one of the glob ``names``
    (``"head"``, ``"blocks.*.norm1"``). With ``dtype=torch.float32`` autocast is
    off inside the module; with a low dtype the module runs under the policy
    with that compute dtype.
    """

    types: tuple[type[nn.Module], ...] = ()
    names: tuple[str, ...] = ()
    dtype: torch.dtype = torch.float32
    # Whether the types hold every one of NORM_TYPES: then norms named like one match too.
    _norms: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # One type or one pattern may be given bare: types=nn.LayerNorm, names="head".
        types, names = self.types, self.names
        object.__setattr__(self, "types", (types,) if isinstance(types, type) else tuple(types))
        object.__setattr__(self, "names", (names,) if isinstance(names, str) else tuple(names))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype, what="module rule dtype"))
        for t in self.types:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise TypeError(f"ModuleRule.types takes nn.Module subclasses, got {t!r}")
        if not self.types and not self.names:
            raise PolicyError("a ModuleRule needs types=(SomeModule, ...) or names=('pattern', ...)")
        object.__setattr__(self, "_norms", all(t in self.types for t in NORM_TYPES))

    def matches(self, module: nn.Module, name: str) -> bool:
        """Whether this rule applies to ``module`` called under qualified ``name`` (with every one of
        :data:`NORM_TYPES` among its types, also a norm of another library: :func:`named_like_a_norm`)."""
        if isinstance(module, self.types) or (self._norms and named_like_a_norm(module)):
            return True
        return bool(self.names) and _name_matches(self.names, name)

    def describe(self) -> str:
        """One line: what matches and the dtype, e.g. ``LayerNorm, 'head' -> fp32``."""
        what = [t.__name__ for t in self.types] + [repr(n) for n in self.names]
        return f"{', '.join(what)} -> {short_name(self.dtype)}"


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]  # Dynamo cannot trace fnmatch's re
def _name_matches(patterns: tuple[str, ...], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)  # fnmatch caches compiled patterns


def rule_items(rule: ModuleRule) -> list[str]:
    """What a rule matches, as the string form writes it: ``norm``, type names, quoted name globs."""
    types = list(rule.types)
    items = []
    if tuple(types[: len(NORM_TYPES)]) == NORM_TYPES:
        items.append("norm")
        del types[: len(NORM_TYPES)]
    items += [_type_name(t) for t in types]
    items += [repr(n) for n in rule.names]
    return items


def _type_name(cls: type) -> str:
    if getattr(nn, cls.__name__, None) is cls:
        return str(cls.__name__)
    return f"{cls.__module__}.{cls.__qualname__}"
