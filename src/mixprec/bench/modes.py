"""How a workload is trained: fp32, torch.amp, mixprec, mixprec with channels_last.

A :class:`Mode` prepares the model and inputs, opens the precision context for the
forward pass and says whether it scales the loss. The registry is open:
:func:`register_mode` adds one (later precision levels plug in here).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.layout import to_channels_last

Context = Callable[[str, torch.dtype], contextlib.AbstractContextManager[Any]]


def _no_context(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _torch_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device_type, dtype=dtype)


def _mixprec_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    return mixprec.autocast(device_type, dtype=dtype)


def _identity(x: Any) -> Any:
    return x


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of training a workload.

    Attributes:
        name: the CLI name.
        description: one line for reports.
        context: ``(device_type, dtype) -> context manager`` around forward and loss.
        scaler: ``(device_type) -> scaler`` used when the dtype is fp16, or ``None`` for no scaling.
        prepare_model: applied to the fresh model (layout changes); returns the model.
        prepare_input: applied to every input batch.
        conv_only: only for workloads with convolutions.
        low_precision: whether it computes in the low dtype (fp32 is the reference).
    """

    name: str
    description: str
    context: Context = _no_context
    scaler: Callable[[str], Any] | None = None
    prepare_model: Callable[[nn.Module], nn.Module] = _identity
    prepare_input: Callable[[torch.Tensor], torch.Tensor] = _identity
    conv_only: bool = False
    low_precision: bool = True
    setup: Callable[[nn.Module, torch.optim.Optimizer, torch.dtype], tuple[nn.Module, torch.optim.Optimizer]] | None = (
        None
    )
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


def _channels_last_input(x: torch.Tensor) -> torch.Tensor:
    return to_channels_last(x) if x.dim() in (4, 5) else x


MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> Mode:
    """Add a mode to the registry (replacing one of the same name); returns it."""
    MODES[mode.name] = mode
    return mode


register_mode(Mode("fp32", "no mixed precision: the reference", low_precision=False))
register_mode(Mode("torch-amp", "torch.autocast, with torch.amp.GradScaler for fp16", _torch_autocast,
                   scaler=lambda device: torch.amp.GradScaler(device)))  # fmt: skip
register_mode(Mode("mixprec", "mixprec.autocast, with mixprec.GradScaler for fp16", _mixprec_autocast,
                   scaler=lambda device: mixprec.GradScaler(device)))  # fmt: skip


def _level(level: str) -> Callable[[nn.Module, torch.optim.Optimizer, torch.dtype], tuple[nn.Module, Any]]:
    def setup(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        return mixprec.prepare(model, optimizer, level=level, dtype=dtype)

    return setup


register_mode(Mode("O2", "mixprec.prepare level O2: low-precision weights, fp32 masters", setup=_level("O2"),
                   scaler=lambda device: mixprec.GradScaler(device)))  # fmt: skip
register_mode(Mode("bf16-sr", "mixprec.prepare level bf16-sr: bf16 weights and state, stochastic rounding",
                   setup=_level("bf16-sr"), dtypes=(torch.bfloat16,)))  # fmt: skip
register_mode(Mode("bf16-pure", "bf16 weights and state, round-to-nearest updates (baseline)",
                   setup=_level("bf16-pure"), dtypes=(torch.bfloat16,)))  # fmt: skip
register_mode(Mode("mixprec-cl", "mixprec with the model and inputs in channels_last", _mixprec_autocast,
                   scaler=lambda device: mixprec.GradScaler(device), prepare_model=to_channels_last,
                   prepare_input=_channels_last_input, conv_only=True))  # fmt: skip
