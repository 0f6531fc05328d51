"""Training under mixprec.autocast gives the parameters torch.autocast gives, bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(64, 4))  # fmt: skip


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.blocks(self.embed(x), mask=mask, is_causal=True))


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(16),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1))  # fmt: skip
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


def _data(kind: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "lm":
        return [(torch.randint(0, 50, (4, 12), generator=g), torch.randint(0, 50, (4, 12), generator=g))
                for _ in range(steps)]  # fmt: skip
    if kind == "cnn":
        return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps)]
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(steps)]


def _train(make: Callable[[], nn.Module], autocast: object, kind: str, dtype: torch.dtype) -> tuple[object, ...]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in _data(kind, 8):
        opt.zero_grad()
        with autocast("cpu", dtype=dtype):  # type: ignore[operator]
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return tuple(losses), tuple(p.detach() for p in model.parameters()), tuple(model.buffers())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("make", "kind"), [(_mlp, "mlp"), (_LM, "lm"), (_CNN, "cnn")], ids=["mlp", "lm", "cnn"])
def test_parameters_bitwise_identical_to_torch_autocast(make: Callable[[], nn.Module], kind: str,
                                                        dtype: torch.dtype) -> None:  # fmt: skip
    expected = _train(make, torch.autocast, kind, dtype)
    got = _train(make, mixprec.autocast, kind, dtype)
    assert bitwise_equal(expected, got)
    assert not bitwise_equal(expected, _train(make, _fp32, kind, dtype))  # the test can fail


class _fp32:  # noqa: N801 - stands where an autocast class goes
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def test_inference_under_no_grad_matches() -> None:
    torch.manual_seed(0)
    model = _LM().eval()
    x = _data("lm", 1)[0][0]
    with torch.no_grad():
        with torch.autocast("cpu"):
            expected = model(x)
        with mixprec.autocast("cpu"):
            got = model(x)
    assert got.dtype is expected.dtype
    assert bitwise_equal(got, expected)  # a mixprec region with the built-in policy is torch's
