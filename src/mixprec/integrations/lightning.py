"""A PyTorch Lightning precision plugin that runs mixprec instead of torch.amp.

``Trainer(plugins=[MixprecPrecision("bf16-mixed")])`` computes what Lightning's own
``precision="bf16-mixed"`` computes, bit for bit, with a mixprec policy you can change;
``"16-mixed"`` adds :class:`mixprec.GradScaler`; ``"O2"``, ``"bf16-sr"`` and ``"bf16-pure"``
apply :func:`mixprec.prepare` to the model and its optimizer when Lightning connects them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from mixprec._src.amp.autocast import autocast
from mixprec._src.policy.rules import Policy
from mixprec._src.prepare.levels import prepare
from mixprec._src.scaling.scaler import GradScaler

PRECISIONS = ("bf16-mixed", "16-mixed", "O2", "bf16-sr", "bf16-pure")


class MixprecPrecision(MixedPrecision):  # type: ignore[misc]
    """Lightning precision plugin backed by mixprec.

    Args:
        precision: ``"bf16-mixed"``, ``"16-mixed"`` (Lightning's names) or a mixprec level
            ``"O2"``, ``"bf16-sr"``, ``"bf16-pure"``.
        device: the autocast device type (``"cpu"``, ``"cuda"``).
        scaler: a GradScaler for ``"16-mixed"`` (default: a new :class:`mixprec.GradScaler`).
        policy: the autocast policy (name, string or :class:`mixprec.Policy`).
        dtype: the low precision of a level (bf16 by default; O2 also takes fp16).

    Raises:
        ValueError: an unknown precision name (the message lists the valid ones).
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str = "cpu",
        scaler: Any = None,
        policy: Policy | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} for MixprecPrecision; valid: {', '.join(PRECISIONS)}")
        self.level = precision if precision in ("O2", "bf16-sr", "bf16-pure") else None
        self.dtype = dtype if self.level else (torch.float16 if precision == "16-mixed" else torch.bfloat16)
        fp16 = self.dtype is torch.float16
        if scaler is None and fp16:
            scaler = GradScaler(device)
        super().__init__("16-mixed" if fp16 else "bf16-mixed", device, scaler)
        self.policy = policy
        self.mixprec_precision = precision

    def autocast_context_manager(self) -> Any:
        # Lightning turns the cache off for its autocast; mixprec's cache follows weight updates
        # (version checks) but matches torch.amp's numbers either way.
        return autocast(self.device, dtype=self.dtype, cache_enabled=False, policy=self.policy)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.level is not None:  # prepared models run their forward under autocast themselves
            yield
            return
        with self.autocast_context_manager():
            yield

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        if self.level is not None:
            if len(optimizers) != 1:
                raise ValueError(
                    f"precision {self.level!r} prepares one optimizer; configure_optimizers gave "
                    f"{len(optimizers)}: use 'bf16-mixed' or '16-mixed' with several"
                )
            model, optimizer = prepare(model, optimizers[0], level=self.level, dtype=self.dtype)
            optimizers = [optimizer]
        return model, optimizers, lr_schedulers
