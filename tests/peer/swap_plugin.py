"""Pytest plugin: run PyTorch's own tests with torch's GradScaler and autocast swapped for mixprec's.

Load it with ``-p swap_plugin`` (with ``tests/peer`` on ``sys.path``). At ``pytest_configure``, before
any test module is imported, it rebinds ``torch.amp.GradScaler``, ``torch.GradScaler`` and
``torch.cpu.amp.GradScaler``, and ``torch.autocast``, ``torch.amp.autocast``,
``torch.amp.autocast_mode.autocast`` and ``torch.cpu.amp.autocast``, to mixprec's. ``torch.cpu.amp``'s
names take no device argument: they get mixprec's classes bound to ``"cpu"``, with torch.cpu.amp's
signatures (subclasses, so ``isinstance`` still holds). Every construction of mixprec's classes is
counted; at the end of the session the counts are written as JSON to the file named by
``$MIXPREC_SWAP_REPORT`` (if set), so the caller can prove that the swap was real. Importing this
module changes nothing.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest

REPORT_ENV = "MIXPREC_SWAP_REPORT"
COUNTS = {"GradScaler": 0, "autocast": 0}
_ORIGINALS = pytest.StashKey[dict[str, Any]]()


def _counting(obj: Any, key: str) -> Any:
    """``obj`` with every construction counted under ``key``: a class patched in place, or a wrapper."""
    if isinstance(obj, type):
        original = obj.__init__

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            COUNTS[key] += 1
            original(self, *args, **kwargs)

        obj.__init__ = __init__  # type: ignore[misc]
        return obj

    @functools.wraps(obj)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        COUNTS[key] += 1
        return obj(*args, **kwargs)

    return wrapper


def _cpu_grad_scaler(scaler: type) -> type:
    """``scaler`` with ``torch.cpu.amp.GradScaler``'s signature: no device argument, bound to ``"cpu"``."""

    class GradScaler(scaler):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            init_scale: float = 2.0**16,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            growth_interval: int = 2000,
            enabled: bool = True,
        ) -> None:
            super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    return GradScaler


def _cpu_autocast(autocast: Any) -> Any:
    """``autocast`` with ``torch.cpu.amp.autocast``'s signature: ``(enabled, dtype, cache_enabled)`` on ``"cpu"``."""
    import torch

    if isinstance(autocast, type):

        class cpu_autocast(autocast):  # type: ignore[misc, valid-type]  # noqa: N801
            def __init__(self, enabled: bool = True, dtype: Any = torch.bfloat16, cache_enabled: bool = True) -> None:
                super().__init__("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        return cpu_autocast

    def cpu_autocast_fn(enabled: bool = True, dtype: Any = torch.bfloat16, cache_enabled: bool = True) -> Any:
        return autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    return cpu_autocast_fn


def swap() -> dict[str, Any]:
    """Rebind torch's names to mixprec's; returns ``{dotted name: (module, name, original)}`` to undo it."""
    import torch
    import torch.amp.autocast_mode

    import mixprec

    scaler = _counting(mixprec.GradScaler, "GradScaler")
    autocast = _counting(mixprec.autocast, "autocast")
    targets: list[tuple[Any, str, str, Any]] = [
        (torch.amp, "torch.amp", "GradScaler", scaler),
        (torch, "torch", "GradScaler", scaler),
        (torch, "torch", "autocast", autocast),
        (torch.amp, "torch.amp", "autocast", autocast),
        (torch.amp.autocast_mode, "torch.amp.autocast_mode", "autocast", autocast),
    ]
    cpu_amp = getattr(torch.cpu, "amp", None)
    if cpu_amp is not None:
        if hasattr(cpu_amp, "GradScaler"):
            targets.append((cpu_amp, "torch.cpu.amp", "GradScaler", _cpu_grad_scaler(scaler)))
        if hasattr(cpu_amp, "autocast"):
            targets.append((cpu_amp, "torch.cpu.amp", "autocast", _cpu_autocast(autocast)))
    originals = {}
    for module, module_name, name, replacement in targets:
        originals[f"{module_name}.{name}"] = (module, name, getattr(module, name))
        setattr(module, name, replacement)
    return originals


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_ORIGINALS] = swap()


def pytest_unconfigure(config: pytest.Config) -> None:
    for module, name, original in config.stash.get(_ORIGINALS, {}).values():
        setattr(module, name, original)
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(COUNTS, f)
