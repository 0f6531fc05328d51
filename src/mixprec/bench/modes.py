"""How a workload is trained: fp32, torch.amp, mixprec, mixprec with channels_last, a tuned recipe.

A :class:`Mode` prepares the model and inputs, opens the precision context for the
forward pass and says whether it scales the loss. The registry is open:
:func:`register_mode` adds one (later precision levels plug in here). A mode with
``resolve`` is settled per workload before training: ``mixprec-tuned`` runs
:func:`mixprec.tune` on the workload and trains with the recipe it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec._src.layout import to_channels_last
from mixprec._src.tune.recipe import Recipe
from mixprec.bench.workloads import Task

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
        setup: ``(model, optimizer, dtype) -> (model, optimizer)`` after the optimizer is made.
        dtypes: the bench dtypes it runs with.
        resolve: ``(task, optimizer, dtype, budget_s) -> Mode``: the mode to train a workload with,
            settled on a fresh copy of it before training (its time is reported apart).
        fp8: whether its linears compute in fp8 (emulated in fp32 on a CPU: reports say so).
        block: whether its linears compute in a block-scaled format (MXFP8, NVFP4: emulated on every device,
            reports say so).
        recipe: the :class:`mixprec.Recipe` it trains with (a tuned mode), for reports.
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
    resolve: Callable[[Task, torch.optim.Optimizer, torch.dtype, float], Mode] | None = None
    fp8: bool = False
    block: bool = False
    recipe: Recipe | None = None

    def trains(self, conv: bool) -> bool:
        """Whether it trains a workload with (``conv``) or without convolutions: channels_last modes only
        the first, fp8 modes only the second (fp8 converts linears; a conv net's only linear is its head)."""
        if self.conv_only:
            return conv
        return not (self.fp8 and conv)


def _channels_last_input(x: torch.Tensor) -> torch.Tensor:
    return to_channels_last(x) if x.dim() in (4, 5) else x


MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> Mode:
    """Add a mode to the registry (replacing one of the same name); returns it."""
    MODES[mode.name] = mode
    return mode


register_mode(Mode("fp32", "no mixed precision: the reference", low_precision=False))
register_mode(
    Mode(
        "torch-amp",
        "torch.autocast, with torch.amp.GradScaler for fp16",
        _torch_autocast,
        scaler=lambda device: torch.amp.GradScaler(device),
    )
)
register_mode(
    Mode(
        "mixprec",
        "mixprec.autocast, with mixprec.GradScaler for fp16",
        _mixprec_autocast,
        scaler=lambda device: mixprec.GradScaler(device),
    )
)


def _level(
    level: str, **options: Any
) -> Callable[[nn.Module, torch.optim.Optimizer, torch.dtype], tuple[nn.Module, Any]]:
    def setup(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        return mixprec.prepare(model, optimizer, level=level, dtype=dtype, **options)

    return setup


register_mode(
    Mode(
        "O1",
        "mixprec.prepare level O1: fp32 weights, the forward under mixprec.autocast, fp32 outputs",
        setup=_level("O1"),
        scaler=lambda device: mixprec.GradScaler(device),
    )
)
register_mode(
    Mode(
        "O1-nokeep",
        "mixprec.prepare level O1 with keep_types=(): no module kept in fp32, as torch.amp",
        setup=_level("O1", keep_types=()),
        scaler=lambda device: mixprec.GradScaler(device),
    )
)
register_mode(
    Mode(
        "O2",
        "mixprec.prepare level O2: low-precision weights, fp32 masters",
        setup=_level("O2"),
        scaler=lambda device: mixprec.GradScaler(device),
    )
)
register_mode(
    Mode(
        "bf16-sr",
        "mixprec.prepare level bf16-sr: bf16 weights and state, stochastic rounding",
        setup=_level("bf16-sr"),
        dtypes=(torch.bfloat16,),
    )
)
register_mode(
    Mode(
        "bf16-pure",
        "bf16 weights and state, round-to-nearest updates (baseline)",
        setup=_level("bf16-pure"),
        dtypes=(torch.bfloat16,),
    )
)
register_mode(
    Mode(
        "bf16-kahan",
        "mixprec.prepare level bf16-kahan: bf16 weights and state, Kahan-compensated updates",
        setup=_level("bf16-kahan"),
        dtypes=(torch.bfloat16,),
    )
)
#: the memory recipes (docs/memory.md): bf16-sr with quantized optimizer state, and with the step in backward
MEMORY_MODES: dict[str, dict[str, Any]] = {
    "bf16-sr-8bit": {"optimizer_state": "8bit"},
    "bf16-sr-8bit-ib": {"optimizer_state": "8bit", "step_in_backward": True},
    "bf16-sr-fp8-ib": {"optimizer_state": "fp8", "step_in_backward": True},
    "bf16-sr-4bit-ib": {"optimizer_state": "4bit", "step_in_backward": True},
}


def _memory(
    options: dict[str, Any],
) -> Callable[[nn.Module, torch.optim.Optimizer, torch.dtype], tuple[nn.Module, Any]]:
    def setup(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        # the bench's fused Adam(W) as torch's plain one: quantized state replaces its step for the large tensors
        group = optimizer.param_groups[0]
        kind: Any = type(optimizer)  # the bench's Adam or AdamW
        plain = kind(
            model.parameters(),
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
        return mixprec.prepare(model, plain, level="bf16-sr", dtype=dtype, **options)

    return setup


for _name, _options in MEMORY_MODES.items():
    _said = ", ".join(f"{k}={v!r}" for k, v in _options.items())
    register_mode(
        Mode(_name, f"mixprec.prepare level bf16-sr with {_said}", setup=_memory(_options), dtypes=(torch.bfloat16,))
    )
register_mode(
    Mode(
        "mixprec-cl",
        "mixprec with the model and inputs in channels_last",
        _mixprec_autocast,
        scaler=lambda device: mixprec.GradScaler(device),
        prepare_model=to_channels_last,
        prepare_input=_channels_last_input,
        conv_only=True,
    )
)


def _fp8(recipe: str) -> Callable[[nn.Module, torch.optim.Optimizer, torch.dtype], tuple[nn.Module, Any]]:
    def setup(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        return mixprec.prepare(model, optimizer, level="O1", dtype=dtype, fp8=recipe)

    return setup


_FP8_MODES = (  # (recipe, mode name, what its linears compute in)
    ("tensorwise", "fp8", "fp8 linears (tensorwise scaling)"),
    ("rowwise", "fp8-rowwise", "fp8 linears (rowwise scaling)"),
    ("delayed", "fp8-delayed", "fp8 linears (delayed scaling)"),
    ("mxfp8", "mxfp8", "mxfp8 linears (block-scaled GEMMs, emulated)"),
    ("nvfp4", "nvfp4", "nvfp4 linears (block-scaled GEMMs, emulated)"),
)
for _recipe, _name, _what in _FP8_MODES:
    register_mode(
        Mode(
            _name,
            f"mixprec.prepare O1 with {_what}, bf16 elsewhere",
            setup=_fp8(_recipe),
            dtypes=(torch.bfloat16,),
            fp8=True,
            block=_recipe in ("mxfp8", "nvfp4"),
        )
    )


#: What a CPU run of an fp8 mode measures.
FP8_EMULATED = (
    "fp8 modes: fp8 GEMMs are emulated in fp32 on a CPU (torch._scaled_mm), so their steps/s say "
    "nothing about fp8 speed on a GPU; their losses are those of real fp8 numerics"
)
#: What a run of a block-scaled mode measures, on any device.
BLOCK_EMULATED = (
    "mxfp8 and nvfp4 modes: their block-scaled GEMMs are emulated on every device (blocks dequantized, an fp32 "
    "GEMM), so their steps/s say nothing about a GPU with block-scaled GEMMs; their losses are real numerics"
)


def recipe_mode(recipe: Recipe, name: str = "mixprec-tuned") -> Mode:
    """A mode that trains with ``recipe`` (its description is the recipe's name)."""

    def context(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
        return recipe.autocast(device_type)()

    def setup(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        applied = recipe.apply(model, optimizer)
        return applied.model, applied.optimizer

    def scaler(device_type: str) -> mixprec.GradScaler:
        return mixprec.GradScaler(device_type, init_scale=recipe.loss_scale)

    layout = _channels_last_input if recipe.layout == "channels_last" else _identity
    return Mode(name, recipe.name, context, scaler=scaler, setup=setup, prepare_input=layout, recipe=recipe)


def _tune(task: Task, optimizer: torch.optim.Optimizer, dtype: torch.dtype, budget_s: float) -> Mode:
    inputs, targets = task.batch(0)

    def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return task.loss_fn(output.float(), targets)

    # The bench's dtype or fp32: the scaler is used exactly when the bench's dtype is fp16.
    recipe = mixprec.tune(
        task.model,
        inputs,
        loss_fn,
        targets=targets,
        optimizer=optimizer,
        budget_s=budget_s,
        dtypes=(dtype, torch.float32),
    )
    return recipe_mode(recipe)


register_mode(
    Mode("mixprec-tuned", "the recipe mixprec.tune measures fastest on this machine within tolerance", resolve=_tune)
)
