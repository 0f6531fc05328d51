"""The built-in policies and the one string form of a policy, parsed back exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec import OpCategory


def test_builtin_cpu_policy_has_torch_cpu_lists() -> None:
    cpu = mixprec.get_policy("cpu")
    for op in (torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.__matmul__, F.linear, torch.conv2d,
               torch.bmm, torch.baddbmm, F.scaled_dot_product_attention):  # fmt: skip
        assert cpu.category_of(op) is OpCategory.LOWER, op
    for op in (torch._C._nn.mse_loss, torch._C._nn.cross_entropy_loss, torch.prod, torch.linalg.solve):
        assert cpu.category_of(op) is OpCategory.FP32, op
    for op in (torch.cat, torch.stack):
        assert cpu.category_of(op) is OpCategory.PROMOTE, op
    assert cpu.category_of(torch.exp) is None  # exp is on CUDA's fp32 list, not CPU's
    assert not cpu.banned and not cpu.fp32_set_dtype


def test_builtin_cuda_policy_has_torch_cuda_lists() -> None:
    cuda = mixprec.get_policy("cuda")
    assert cuda.category_of(torch.mm) is OpCategory.LOWER
    assert cuda.category_of(torch.addmv) is OpCategory.LOWER
    assert cuda.category_of(torch.exp) is OpCategory.FP32
    assert cuda.category_of(torch.layer_norm) is OpCategory.FP32
    assert cuda.category_of(torch.softmax) is OpCategory.FP32_SET_DTYPE
    assert cuda.category_of(torch.sum) is OpCategory.FP32_SET_DTYPE
    assert cuda.category_of(torch.addcmul) is OpCategory.PROMOTE
    assert cuda.category_of(torch._C._nn.binary_cross_entropy) is OpCategory.BANNED


def test_builtin_policies_leave_out_ops_the_installed_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    # another torch than the one the tables were read from lacks some of their ops (torch 2.14 has no 'qr'):
    # the built-in policies then hold the rest, and importing mixprec does not fail
    from mixprec._src import op_names
    from mixprec._src.policy import rules as policy

    gone = {"qr", "addmv", "binary_cross_entropy"}
    real = op_names.exists
    monkeypatch.setattr(op_names, "exists", lambda name: name not in gone and real(name))
    cpu, cuda = policy._builtin("cpu"), policy._builtin("cuda")
    assert "qr" not in cpu.fp32 and "linalg_qr" in cpu.fp32
    assert "addmv" not in cuda.lower and "mm" in cuda.lower and "binary_cross_entropy" not in cuda.banned


def test_default_policy_per_device() -> None:
    assert mixprec.default_policy("cpu") is mixprec.builtin_policy("cpu")
    assert mixprec.default_policy("cuda") is mixprec.builtin_policy("cuda")


@pytest.mark.parametrize(
    ("spec", "compute", "output", "base", "rules"),
    [
        ("cpu", None, None, "cpu", 0),
        ("compute=bf16", torch.bfloat16, None, "cpu", 0),
        ("compute=fp16, output=fp32", torch.float16, torch.float32, "cpu", 0),
        ("base=cuda,compute=bf16,keep=norm", torch.bfloat16, None, "cuda", 1),
    ],
)
def test_string_form(spec: str, compute: torch.dtype | None, output: torch.dtype | None, base: str, rules: int) -> None:
    policy = mixprec.get_policy(spec)
    assert policy.compute_dtype is compute
    assert policy.output_dtype is output
    assert policy.lower == mixprec.builtin_policy(base).lower
    assert len(policy.module_rules) == rules


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("compute=int8", "unknown compute dtype 'int8'; valid names: bf16"),
        ("compute=fp32", "compute dtype torch.float32 .* use one of"),
        ("output=fp8", "unknown output dtype 'fp8'"),
        ("base=tpu", "unknown base='tpu'.*built-in policies: cpu, cuda"),
        ("keep=all", "unknown keep='all'; valid: keep=norm"),
        ("fast", "unknown policy 'fast'; a policy string is a built-in name .cpu, cuda. or comma-separated"),
        ("lower:+nonexistent_op", "a policy string is a built-in name"),
        ("compute=bf16,compute=fp16", "policy key 'compute' is given twice"),
        ("fp32=nonexistent_op", "unknown op 'nonexistent_op'.*in policy string"),
        ("fp32=", "names no ops"),
        ("compute", "unknown policy 'compute'"),
        ("speed=max", "bad policy field 'speed=max'"),
    ],
)
def test_string_form_errors_list_valid_names(spec: str, match: str) -> None:
    with pytest.raises(mixprec.PolicyError, match=match) as raised:
        mixprec.get_policy(spec)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, mixprec.MixprecError)


@given(
    compute=st.sampled_from(["bf16", "bfloat16", "fp16", "half", "float16"]),
    output=st.sampled_from([None, "fp32", "bf16", "fp16"]),
    base=st.sampled_from([None, "cpu", "cuda"]),
)
def test_string_form_round_trip(compute: str, output: str | None, base: str | None) -> None:
    parts = [f"compute={compute}"] + ([f"output={output}"] if output else []) + ([f"base={base}"] if base else [])
    policy = mixprec.get_policy(",".join(parts))
    assert policy.compute_dtype is mixprec.get_policy(f"compute={compute}").compute_dtype
    assert policy == mixprec.get_policy(",".join(reversed(parts)))


def test_describe_lists_every_category() -> None:
    text = mixprec.get_policy("cuda").keep_modules(types=[nn.LayerNorm]).describe()
    for category in OpCategory:
        assert f"  {category.value} (" in text
    assert "module rule: LayerNorm -> fp32" in text


def test_string_form_moves_ops() -> None:
    policy = mixprec.get_policy("base=cpu,fp32=scaled_dot_product_attention+exp,none=stack")
    cpu = mixprec.get_policy("cpu")
    assert policy == cpu.add("fp32", "scaled_dot_product_attention", "exp").remove("stack")
    assert str(policy) == "base=cpu,fp32=exp+scaled_dot_product_attention,none=stack"


def test_repr_is_one_readable_line() -> None:
    policy = mixprec.get_policy("cuda").add("fp32", F.scaled_dot_product_attention).keep_modules(nn.LayerNorm, "head")
    # a move out of torch's lower list into fp32 shows once, as where the op is now
    assert repr(policy) == "Policy(\"base=cuda,fp32=scaled_dot_product_attention,keep=LayerNorm+'head'\")"
    assert "<built-in" not in repr(policy) and "\n" not in repr(policy)


class _LocalNorm(nn.LayerNorm):
    pass


_OPS = sorted({*mixprec.get_policy("cpu").op_table, *mixprec.get_policy("cuda").op_table, "exp", "log", "add"})


_HINTS = st.one_of(st.none(), st.text(st.sampled_from("ab ,'\"+:=x"), min_size=1, max_size=12))


_EDITS = st.one_of(
    st.tuples(st.just("add"), st.sampled_from([c.value for c in OpCategory]),
              st.lists(st.sampled_from(_OPS), min_size=1, max_size=3), _HINTS),
    st.tuples(st.just("remove"), st.lists(st.sampled_from(_OPS), min_size=1, max_size=3)),
    st.tuples(st.just("keep"), st.lists(st.sampled_from([nn.LayerNorm, nn.Linear, _LocalNorm, nn.BatchNorm1d]),
              max_size=2, unique=True), st.lists(st.sampled_from(["head", "blocks.*.attn", "a+b", "x,y", "it's"]),
              max_size=2, unique=True), st.sampled_from(["fp32", "bf16", "fp16"]), st.booleans()),
)  # fmt: skip


@given(base=st.sampled_from(["cpu", "cuda"]), compute=st.sampled_from([None, "bf16", "fp16"]),
       output=st.sampled_from([None, "fp32", "bf16"]), edits=st.lists(_EDITS, max_size=5))  # fmt: skip
@example(base="cpu", compute=None, output=None, edits=[("add", "banned", ["mm"], "use 'matmul', x:=1")])  # always tried
def test_the_string_form_parses_back_exactly(base: str, compute: str | None, output: str | None, edits: list) -> None:
    """``get_policy(str(p)) == p`` for any edits: moves, bans with any hint, rules of any type, name and dtype."""
    policy = mixprec.get_policy(base)
    changes = {"compute_dtype": compute and getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[compute]),
               "output_dtype": output and getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[output])}  # fmt: skip
    policy = dataclasses.replace(policy, **changes)
    for edit in edits:
        if edit[0] == "add":
            policy = policy.add(edit[1], *edit[2], hint=edit[3])
        elif edit[0] == "remove":
            policy = policy.remove(*edit[1], missing_ok=True)
        elif edit[1] or edit[2]:
            types = [t for t in edit[1] if t is not _LocalNorm] + ([*mixprec.NORM_TYPES] if edit[4] else [])
            if types or edit[2]:
                policy = policy.keep_modules(types, edit[2], dtype=edit[3])
    text = str(policy)
    assert "\n" not in text and repr(policy) == f"Policy({text!r})"
    again = mixprec.get_policy(text, device_type="cuda" if base == "cpu" else "cpu")  # base= is always written
    assert again == policy
    assert str(again) == text
    assert again.banned == policy.banned and again.module_rules == policy.module_rules


def test_the_string_form_names_importable_types_in_full() -> None:
    from torch.nn.modules.normalization import RMSNorm

    custom = mixprec.get_policy("cpu").keep_modules(torch.ao.nn.quantized.LayerNorm)
    assert "keep=torch.ao.nn.quantized.modules.normalization.LayerNorm" in str(custom)
    assert mixprec.get_policy(str(custom)) == custom
    assert str(mixprec.get_policy("cpu").keep_modules(RMSNorm)) == "base=cpu,keep=RMSNorm"
    local = mixprec.get_policy("cpu").keep_modules(_LocalNorm)  # importable: a module-level class of this test file
    assert mixprec.get_policy(str(local)) == local
