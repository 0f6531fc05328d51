"""A ``forward`` bound to one module instance that survives ``torch.save(model)`` and ``torch.load``.

fp8 conversion and per-layer precision give single layers a forward of their own, and prepare gives the
model its forward and its call (the level's region around the original forward). A bound method
of a module-level function pickles as ``getattr(module, function name)``, which fails on load (the
module has no such attribute); :class:`BoundForward` pickles as the function and the module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["bind", "bound_function", "BoundForward"]


class BoundForward:
    """``func(module, *args, **kwargs)`` as ``module.forward``."""

    __slots__ = ("func", "module")

    def __init__(self, func: Callable[..., Any], module: nn.Module) -> None:
        self.func, self.module = func, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(self.module, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return BoundForward, (self.func, self.module)

    @property
    def __code__(self) -> Any:  # a bound method's, which torch.export reads to name its trace
        return self.func.__code__


def bind(module: nn.Module, func: Callable[..., Any]) -> None:
    """Make ``func(module, ...)`` the forward of this instance (in place)."""
    module.forward = BoundForward(func, module)  # type: ignore[method-assign]


def bound_function(module: nn.Module) -> Callable[..., Any] | None:
    """The function :func:`bind` gave ``module``, or ``None``."""
    forward = module.__dict__.get("forward")
    return forward.func if isinstance(forward, BoundForward) else None
