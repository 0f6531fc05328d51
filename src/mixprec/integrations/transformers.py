"""A Hugging Face ``transformers.Trainer`` that trains with mixprec instead of torch.amp.

``MixprecTrainer(model, TrainingArguments(bf16=True, ...), ..., policy="keep=norm")`` is used
exactly like ``Trainer``; the precision comes from the arguments' ``bf16``/``fp16`` flags, or from
``precision=``. mixprec then does all of it and Accelerate none (the Trainer's Accelerator runs
with ``mixed_precision="no"``):

* ``compute_loss`` (forward and loss, in training and evaluation) runs under
  :func:`mixprec.autocast` with ``policy``;
* fp16 scales the loss with a :class:`mixprec.GradScaler`, unscales before the Trainer clips
  or measures the gradients, and skips steps whose gradients hold inf/NaN (the learning-rate
  schedule does not advance on a skipped step, as with Accelerate). This holds on a CPU too,
  where ``Trainer(fp16=True)`` quietly trains in fp32;
* ``level=`` (any level of :func:`mixprec.prepare`: ``"O1"``, ``"O2"``, ``"bf16-sr"``, ``"bf16-kahan"``,
  ``"bf16-pure"``, or a whole :class:`mixprec.PrepareConfig`: quantized optimizer state, fp8, the step in
  backward) applies :func:`mixprec.prepare` to the model and the optimizer when the Trainer creates the
  optimizer; a prepared model runs its forward under autocast itself (with its norm layers in fp32), so
  ``policy`` does not apply.

With the built-in policy and no level, the numbers equal ``Trainer``'s own bf16 AMP bit for bit
(tested on CPU). Not covered: DeepSpeed and FSDP (their own mixed precision), and a custom
``optimizers=`` pair with a level (prepare the model and optimizer yourself instead).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import Trainer

import mixprec

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
LEVELS = tuple(level.value for level in mixprec.Level)


class MixprecTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with mixprec autocast, GradScaler and ``prepare`` levels.

    Args:
        *args, **kwargs: as for ``Trainer``.
        precision: ``"bf16"`` or ``"fp16"``; default: from ``TrainingArguments`` (``bf16=True`` or
            ``fp16=True``), else fp32 (no level) or bf16 (with a level).
        policy: the autocast policy (a name, a string such as ``"keep=norm"``, or a
            :class:`mixprec.Policy`); default: the device's built-in one.
        level: a level of :func:`mixprec.prepare` (``"O2"``, ``"bf16-sr"``, ...) or a
            :class:`mixprec.PrepareConfig` (every option prepare takes; its dtype is the precision unless
            ``precision`` or the arguments say otherwise, which then must agree).
        scaler: the GradScaler for fp16 (default: a new :class:`mixprec.GradScaler`).

    Raises:
        ValueError: an unknown precision or level (the message lists the valid ones), a level
            the precision does not allow (the bf16 levels with fp16), or a config of another precision.
    """

    def __init__(
        self,
        *args: Any,
        precision: str | None = None,
        policy: mixprec.Policy | str | None = None,
        level: str | mixprec.PrepareConfig | None = None,
        scaler: mixprec.GradScaler | None = None,
        **kwargs: Any,
    ) -> None:
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} for MixprecTrainer; valid: {', '.join(PRECISIONS)}")
        self.mixprec_config = level if isinstance(level, mixprec.PrepareConfig) else None
        if self.mixprec_config is not None:
            level = self.mixprec_config.level.value  # type: ignore[attr-defined]
        if level is not None and level not in LEVELS:
            raise ValueError(
                f"unknown level {level!r} for MixprecTrainer; valid: {', '.join(LEVELS)}, a "
                "mixprec.PrepareConfig (or none: autocast only)"
            )
        self.mixprec_level = level
        self.mixprec_policy = policy
        self._mixprec_precision = precision
        self._mixprec_scaler = scaler
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        bf16_weights = self.mixprec_level is not None and mixprec.Level.from_name(self.mixprec_level).bf16_weights
        config = self.mixprec_config
        if config is not None and self.mixprec_dtype is not config.dtype:
            raise ValueError(
                f"the PrepareConfig computes in {config.dtype} and the Trainer in "
                f"{self.mixprec_dtype}: make them agree (TrainingArguments' bf16/fp16, precision=, "
                "PrepareConfig(dtype=))"
            )
        if bf16_weights and self.mixprec_dtype is not torch.bfloat16:
            raise ValueError(
                f"level {self.mixprec_level!r} keeps weights in bf16: use precision='bf16' (or "
                "TrainingArguments(bf16=True)), or level 'O2' for fp16"
            )
        super().create_accelerator_and_postprocess()
        if self.mixprec_dtype is not torch.float16:
            self._mixprec_scaler = None
        elif self._mixprec_scaler is None:
            self._mixprec_scaler = mixprec.GradScaler(self.args.device.type)
        # Accelerate steps the optimizer through its scaler, but unscales only for its own AMP.
        self.accelerator.scaler = self._mixprec_scaler
        self.accelerator.unscale_gradients = self._unscale_gradients

    @property
    def mixprec_dtype(self) -> torch.dtype | None:
        """The low precision trained in, or ``None`` for fp32."""
        name = self._mixprec_precision
        if name is None and not self.args.fp16 and not self.args.bf16 and self.mixprec_config is not None:
            return self.mixprec_config.dtype  # type: ignore[no-any-return]
        if name is None:
            name = "fp16" if self.args.fp16 else "bf16" if (self.args.bf16 or self.mixprec_level) else None
        return None if name is None else PRECISIONS[name]

    @property
    def mixprec_scaler(self) -> mixprec.GradScaler | None:
        """The GradScaler of an fp16 run, else ``None``."""
        return self._mixprec_scaler

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # mixprec does the mixed precision, not Accelerate's torch.amp
        return args

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """The mixprec autocast region around ``compute_loss`` (none for fp32 or a prepared model)."""
        dtype = self.mixprec_dtype
        if dtype is None or self.mixprec_level is not None:
            return contextlib.nullcontext()
        return mixprec.autocast(
            self.args.device.type, dtype=dtype, policy=self.mixprec_policy, cache_enabled=bool(cache_enabled)
        )

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        creating = self.optimizer is None
        optimizer: torch.optim.Optimizer = super().create_optimizer(model)
        if creating and self.mixprec_level is not None:
            target: Any = self.model if model is None else model
            dtype = self.mixprec_dtype or torch.bfloat16
            config = self.mixprec_config or mixprec.PrepareConfig(
                level=mixprec.Level.from_name(self.mixprec_level), dtype=dtype
            )
            _, optimizer = mixprec.prepare(target, optimizer, config)
            self.optimizer = optimizer
        return optimizer

    def _unscale_gradients(self, optimizer: Any = None) -> None:
        # Accelerator.clip_grad_norm_ calls this before clipping (and the Trainer before logging the norm).
        if self._mixprec_scaler is None:
            return
        optimizers = self.accelerator._optimizers if optimizer is None else optimizer
        if not isinstance(optimizers, (list, tuple)):
            optimizers = [optimizers]
        for opt in optimizers:
            self._mixprec_scaler.unscale_(getattr(opt, "optimizer", opt))  # the AcceleratedOptimizer's own
