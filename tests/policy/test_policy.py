"""Policy: frozen data, torch's lists, editing, string form, module rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import OpCategory, Policy


def test_policy_is_frozen_and_hashable() -> None:
    policy = mixprec.get_policy("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.banned[torch.mm] = "no"  # type: ignore[index]
    assert hash(policy) == hash(dataclasses.replace(policy))
    assert policy == dataclasses.replace(policy)


def test_add_moves_and_remove_drops() -> None:
    base = mixprec.get_policy("cpu")
    moved = base.add("fp32", torch.mm)
    assert moved.category_of(torch.mm) is OpCategory.FP32
    assert "mm" not in moved.lower and "mm" in moved.fp32  # ops are stored by ATen name
    assert base.category_of(torch.mm) is OpCategory.LOWER  # the original is unchanged
    dropped = moved.remove(torch.mm)
    assert dropped.category_of(torch.mm) is None
    with pytest.raises(ValueError, match="in no category"):
        dropped.remove(torch.mm)
    banned = base.add(OpCategory.BANNED, torch.exp, hint="use torch.special.expit")
    assert banned.banned["exp"] == "use torch.special.expit"


def test_one_category_per_op() -> None:
    with pytest.raises(ValueError, match="in both 'lower' and 'fp32'"):
        Policy(lower=frozenset({torch.mm}), fp32=frozenset({torch.mm}))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda p: p.add("fast", torch.mm), ValueError, "unknown op category 'fast'; valid categories: lower, fp32"),
        (lambda p: p.add("lower"), ValueError, "at least one op"),
        (lambda p: p.add("lower", "mmm"), ValueError, "unknown op 'mmm' .did you mean 'mm'"),
        (lambda p: p.add("lower", print), TypeError, "not a torch op a policy can list.*@mixprec.op"),
        (lambda p: p.add("lower", "nolib::nothing"), ValueError, "no operator 'nothing' is registered"),
        (lambda p: p.keep_modules(), ValueError, "needs types="),
        (lambda p: p.keep_modules(types=[int]), TypeError, "nn.Module subclasses"),
        (lambda p: p.keep_modules(types=[nn.LayerNorm], dtype=torch.int8), ValueError, "non-floating"),
    ],
)
def test_bad_edits_name_the_fix(call: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call(mixprec.get_policy("cpu"))  # type: ignore[operator]


def test_module_rule_matching() -> None:
    rule = mixprec.ModuleRule(types=(nn.LayerNorm,), names=("head", "blocks.*.attn"))
    assert rule.matches(nn.LayerNorm(4), "anything")
    assert rule.matches(nn.Linear(2, 2), "head")
    assert rule.matches(nn.Linear(2, 2), "blocks.3.attn")
    assert not rule.matches(nn.Linear(2, 2), "blocks.3.mlp")
    assert all(issubclass(t, nn.Module) for t in mixprec.NORM_TYPES)
    assert isinstance(nn.BatchNorm2d(3), mixprec.NORM_TYPES)
    # one type or one pattern may be given bare
    bare = mixprec.get_policy("cpu").keep_modules(nn.LayerNorm, names="head").module_rules[0]
    assert bare.types == (nn.LayerNorm,) and bare.names == ("head",)


def test_equal_policies_become_one_object_in_autocast() -> None:
    # torch.compile guards on the policy object; a policy rebuilt each step must not recompile
    first = mixprec.get_policy("cpu").keep_modules(nn.LayerNorm)
    again = mixprec.get_policy("cpu").keep_modules(nn.LayerNorm)
    assert first is not again and first == again and hash(first) == hash(again)
    assert mixprec.autocast("cpu", policy=again).policy is mixprec.autocast("cpu", policy=first).policy
    other = mixprec.get_policy("cpu").keep_modules(nn.BatchNorm1d)
    assert mixprec.autocast("cpu", policy=other).policy is not mixprec.autocast("cpu", policy=first).policy


def test_an_edited_policy_says_so_in_its_name() -> None:
    cpu = mixprec.get_policy("cpu")
    assert cpu.name == "cpu"
    for edited in (
        cpu.add("fp32", "exp"),
        cpu.remove("mm"),
        cpu.keep_modules(nn.LayerNorm),
        cpu.add("fp32", "exp").remove("mm"),
    ):
        assert edited.name == "cpu (edited)"
        assert edited.describe().startswith(f"Policy 'cpu (edited)': {edited}\n")
    with pytest.raises(ValueError, match="policy 'cpu \\(edited\\)'"):
        cpu.remove("mm").remove("mm")


@pytest.mark.parametrize(
    ("op", "name"),
    [(torch.mm, "mm"), (torch.Tensor.mm, "mm"), (torch.Tensor.__matmul__, "matmul"), (F.linear, "linear"),
     (F.cross_entropy, "cross_entropy_loss"), (F.mse_loss, "mse_loss"), (torch.ops.aten.mm, "mm"),
     (torch.ops.aten.mm.default, "mm"), ("aten::mm", "mm"), (F.scaled_dot_product_attention,
     "scaled_dot_product_attention")],
)  # fmt: skip
def test_ops_are_named_as_torchs_lists_name_them(op: object, name: str) -> None:
    assert mixprec.op_name(op) == name  # type: ignore[arg-type]
