"""Module rules: per-module dtypes in a policy, applied at module boundaries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from helpers import bitwise_equal, mm_dtype

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 8)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        self.seen["proj"] = h.dtype
        h = self.norm(h)
        self.seen["norm"] = h.dtype
        out = self.head(h)
        self.seen["head"] = out.dtype
        return out


def test_module_rule_by_type() -> None:
    block = _Block()
    policy = mixprec.get_policy("cpu").keep_modules(types=mixprec.NORM_TYPES)
    with mixprec.autocast("cpu", policy=policy):
        block(torch.randn(2, 8))
    assert block.seen == {"proj": BF16, "norm": FP32, "head": BF16}


def test_module_rule_by_name_and_nested_model() -> None:
    model = nn.Sequential(_Block(), _Block())
    policy = mixprec.get_policy("cpu").keep_modules(names=["1.head"])
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(2, 8))
    assert model[0].seen["head"] is BF16
    assert model[1].seen["head"] is FP32
    assert model[1].seen["proj"] is BF16


def test_module_rule_with_low_dtype_and_string_form() -> None:
    block = _Block()
    policy = mixprec.get_policy("cpu").keep_modules(names=["head"], dtype="fp16")
    with mixprec.autocast("cpu", policy=policy):
        block(torch.randn(2, 8))
    assert block.seen["head"] is FP16 and block.seen["proj"] is BF16
    with mixprec.autocast("cpu", policy="keep=norm"):
        block(torch.randn(2, 8))
    assert block.seen["norm"] is FP32


def test_module_rule_restored_after_exception_and_hooks_removed() -> None:
    class Exploding(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside")

    model = nn.Sequential(nn.Linear(4, 4), Exploding(4))
    policy = mixprec.get_policy("cpu").keep_modules(types=[nn.LayerNorm])
    with mixprec.autocast("cpu", policy=policy):
        with pytest.raises(RuntimeError, match="inside"):
            model(torch.randn(2, 4))
        assert mm_dtype() is BF16  # the fp32 rule of the failed module is gone
    assert not nn.modules.module._global_forward_pre_hooks
    assert not nn.modules.module._global_forward_hooks
    assert not nn.modules.module._global_forward_hooks_always_called


def test_module_rules_match_torch_when_done_by_hand() -> None:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 8)
    policy = mixprec.get_policy("cpu").keep_modules(types=[nn.LayerNorm])
    with mixprec.autocast("cpu", policy=policy):
        got = block(x)
    with torch.autocast("cpu"):
        h = block.proj(x)
        with torch.autocast("cpu", enabled=False):
            h = block.norm(h.float())
        expected = block.head(h)
    assert bitwise_equal(expected, got)
