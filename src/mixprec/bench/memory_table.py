"""The bench's memory table (``mixprec bench --memory-budget 4GiB``): per mode, the bytes a parameter the bench
transformer holds, the largest bench transformer (more layers at the size's width, batch and sequence) that fits
in the budget, and the mode's final loss against fp32 AdamW where the run trained it.

Bytes come from :func:`mixprec.memory_plan` (byte for byte what ``memory_report`` counts after a step); the largest
model from its predicted peak, which grows by about the same bytes with each layer: two plans give the slope, and
a search from there finds the last that fits. Nothing here trains or allocates a model's weights beyond the size's own.
"""

from __future__ import annotations

from typing import Any

import torch

import mixprec
from mixprec.bench.modes import MEMORY_MODES
from mixprec.bench.workloads import WORKLOADS, TinyLM

__all__ = ["HEADER", "config_of", "rows"]

HEADER = ("mode", "bytes/param", "peak (plan)", "largest transformer in the budget", "final loss vs fp32")
_LEVELS = ("O1", "O2", "bf16-sr", "bf16-kahan", "bf16-pure")


def config_of(mode: str) -> Any:
    """What ``mode`` prepares with, for :func:`mixprec.memory_plan` (``None``: a mode it does not plan)."""
    if mode == "fp32":
        return "fp32"
    if mode in ("torch-amp", "mixprec", "O1"):
        return mixprec.PrepareConfig(level=mixprec.Level.O1)
    if mode in _LEVELS:
        return mixprec.PrepareConfig(level=mixprec.Level.from_name(mode))
    if mode in MEMORY_MODES:
        return mixprec.PrepareConfig(level=mixprec.Level.BF16_SR, **MEMORY_MODES[mode])
    return None


def _plan(layers: int, dim: int, tokens: torch.Tensor, config: Any) -> tuple[mixprec.MemoryPlan, int]:
    """The plan and the parameter count of the bench transformer with ``layers`` layers (built on meta)."""
    model = TinyLM(256, dim, layers, heads=max(1, dim // 64)).to("meta")
    optimizer = torch.optim.AdamW(model.parameters())
    plan = mixprec.memory_plan(
        model,
        optimizer,
        config,
        batch=tokens[:, :-1],
        loss_fn=lambda out: torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens[:, 1:].flatten()),
    )
    return plan, sum(p.numel() for p in model.parameters())


def _peak(layers: int, dim: int, tokens: torch.Tensor, config: Any) -> int:
    peak = _plan(layers, dim, tokens, config)[0].peak
    assert peak is not None
    return peak


def largest(config: Any, dim: int, tokens: torch.Tensor, budget: int) -> tuple[int, int]:
    """(layers, parameters) of the largest bench transformer whose predicted peak fits ``budget`` (0 layers: none).

    The peak grows by about the same bytes a layer: the slope of the first two layers' peaks gives a first guess,
    then the guess is moved down while it does not fit and up (doubling the stride, then halving it) while the next
    fits: a step in backward's bucket of gradients fills within the first layers, so the slope there overstates the
    rest."""

    def fits(layers: int) -> bool:
        return _peak(layers, dim, tokens, config) <= budget

    one, two = _peak(1, dim, tokens, config), _peak(2, dim, tokens, config)
    slope = max(1, two - one)
    layers = max(0, int((budget - one) // slope) + 1)
    while layers > 0 and not fits(layers):
        layers -= 1
    if layers:  # the largest that fits is at or above the guess: find the first that does not, then the last that does
        stride = 1
        while fits(layers + stride):
            layers, stride = layers + stride, stride * 2
        while stride > 1:
            stride //= 2
            if fits(layers + stride):
                layers += stride
    return layers, (_plan(layers, dim, tokens, config)[1] if layers else 0)


def rows(modes: list[str], size: str, budget: int, losses: dict[str, float] | None = None) -> list[tuple[str, ...]]:
    """The table's rows for ``modes`` (those :func:`config_of` plans) at the bench transformer's ``size``."""
    task = WORKLOADS["transformer"].build(size, torch.device("cpu"))
    x, y = task.batch(0)
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    model: Any = task.model
    dim, layers = int(model.embed.embedding_dim), len(model.blocks.layers)
    fp32_loss = (losses or {}).get("fp32")
    out: list[tuple[str, ...]] = []
    for mode in modes:
        config = config_of(mode)
        if config is None:
            continue
        plan, params = _plan(layers, dim, tokens, config)
        fits, fitted_params = largest(config, dim, tokens, budget)
        loss = (losses or {}).get(mode)
        vs = f"{loss:.4f} ({(loss - fp32_loss) / fp32_loss:+.2%})" if loss is not None and fp32_loss else "-"
        out.append(
            (
                mode,
                f"{plan.state / params:.2f}",
                f"{(plan.peak or 0) / 2**20:.1f} MiB",
                f"{fits} layers, {fitted_params / 1e6:.1f}M parameters" if fits else "none",
                vs,
            )
        )
    return out
