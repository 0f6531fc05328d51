"""PyTorch Lightning and Hugging Face Accelerate run mixprec with the numbers of their own AMP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import bitwise_equal

# The frameworks warn about CPU-only runs, worker counts and logging: not ours to fix here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


# --- Lightning ------------------------------------------------------------------------------


def _lightning_run(**trainer_kwargs: Any) -> tuple[list[torch.Tensor], list[float]]:
    pl = pytest.importorskip("lightning.pytorch")

    class Regressor(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = Regressor()
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)  # fmt: skip
    trainer.fit(model, loader)
    masters = trainer.optimizers[0].param_groups[0]["params"]
    return [p.detach().float().clone() for p in masters], model.losses


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_plugin_matches_lightning_amp(precision: str) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.integrations.lightning import MixprecPrecision

    # Lightning's own plugin, named explicitly: Trainer(precision="16-mixed") on a CPU switches to bf16.
    expected = _lightning_run(plugins=[MixedPrecision(precision, "cpu")])
    got = _lightning_run(plugins=[MixprecPrecision(precision)])
    assert bitwise_equal(expected, got)
    assert not bitwise_equal(expected, _lightning_run(precision="32-true"))  # the comparison can fail


def test_lightning_plugin_levels() -> None:
    pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    params, losses = _lightning_run(plugins=[MixprecPrecision("O2")])
    assert all(p.dtype is torch.float32 for p in params)  # the optimizer holds fp32 masters
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="valid: bf16-mixed, 16-mixed, O2"):
        MixprecPrecision("O3")


# --- Accelerate -----------------------------------------------------------------------------


def _accelerate_run(cls: Any, mixed_precision: str) -> tuple[list[torch.Tensor], list[float]]:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = cls(mixed_precision=mixed_precision, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
    with accelerator.autocast():
        inside = model(x).dtype
    AcceleratorState._reset_state(reset_partial_state=True)
    return [p.detach().clone() for p in model.parameters()], [*losses, str(inside)]  # type: ignore[list-item]


def test_accelerate_matches_accelerate_amp() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from mixprec.integrations.accelerate import MixprecAccelerator

    expected = _accelerate_run(Accelerator, "bf16")
    got = _accelerate_run(MixprecAccelerator, "bf16")
    assert bitwise_equal(expected, got)
    assert got[1][-1] == "torch.float32"  # outputs come back in fp32, as Accelerate does
    assert not bitwise_equal(expected, _accelerate_run(Accelerator, "no"))


def test_accelerate_fp16_on_cpu_trains_fp32_as_accelerate_does() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from mixprec.integrations.accelerate import MixprecAccelerator

    expected = _accelerate_run(Accelerator, "fp16")
    assert bitwise_equal(expected, _accelerate_run(Accelerator, "no"))  # Accelerate: fp32 on a CPU, silently
    with pytest.warns(UserWarning, match=r"mixed_precision='fp16'\) on CPU trains in fp32"):
        got = _accelerate_run(MixprecAccelerator, "fp16")
    assert bitwise_equal(expected, got)
