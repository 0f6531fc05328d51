"""A Hugging Face Accelerate ``Accelerator`` that runs mixprec instead of torch.amp.

``MixprecAccelerator(mixed_precision="bf16")`` is used exactly like ``Accelerator``: the models
it prepares run their forward under :func:`mixprec.autocast` (outputs in fp32, as Accelerate
does), ``accelerator.autocast()`` opens a mixprec region, and with ``mixed_precision="fp16"``
backward and the prepared optimizers use :class:`mixprec.GradScaler`.

What matches ``Accelerator`` bit for bit with the default policy (tested on CPU): ``"bf16"``,
and ``"fp16"`` on a CPU, where Accelerate trains in fp32 (no autocast, no scaler) and so does
this class, with a warning saying so. ``"fp16"`` on a GPU runs mixprec's autocast and GradScaler
where Accelerate runs torch's: the same numbers by construction (mixprec is a drop-in for both),
not checked here without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Generator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import convert_outputs_to_fp32

from mixprec._src.amp.autocast import autocast
from mixprec._src.policy.rules import Policy
from mixprec._src.scaling.scaler import GradScaler


class MixprecAccelerator(Accelerator):  # type: ignore[misc]
    """``Accelerator`` with mixprec autocast and GradScaler; ``policy`` picks the precision policy."""

    def __init__(self, *args: Any, policy: Policy | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mixprec_policy = policy
        self.mixprec_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.mixed_precision))
        if self.mixprec_dtype is torch.float16 and self.device.type == "cpu":
            # Accelerator skips autocast and the scaler for fp16 on a CPU; a drop-in does the same, aloud.
            warnings.warn(
                "MixprecAccelerator(mixed_precision='fp16') on CPU trains in fp32, as Accelerate's "
                "Accelerator does there (no autocast, no GradScaler); for low precision on a CPU use "
                "mixed_precision='bf16'",
                UserWarning,
                stacklevel=2,
            )
            self.mixprec_dtype = None
        if self.mixprec_dtype is torch.float16:
            self.scaler = GradScaler(self.device.type)

    def _mixprec_region(self) -> Any:
        if self.mixprec_dtype is None:
            return contextlib.nullcontext()
        return autocast(self.device.type, dtype=self.mixprec_dtype, policy=self.mixprec_policy)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        native_amp: bool = getattr(self, "native_amp", False)
        self.native_amp = False  # keep Accelerate from adding torch.autocast
        try:
            model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        finally:
            self.native_amp = native_amp
        if self.mixprec_dtype is not None and not hasattr(model, "_mixprec_forward"):
            # Accelerate's own wrapping (autocast around forward, outputs to fp32), with mixprec's region: the
            # numbers stay Accelerate's. mixprec.prepare would keep norms in fp32 and change them.
            forward = model.forward

            @functools.wraps(forward)
            def mixed_forward(*args: Any, **kwargs: Any) -> Any:
                with self._mixprec_region():
                    return forward(*args, **kwargs)

            object.__setattr__(model, "_mixprec_forward", forward)
            object.__setattr__(model, "forward", convert_outputs_to_fp32(mixed_forward))
        return model

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Generator[None, None, None]:
        with self._mixprec_region():
            yield
