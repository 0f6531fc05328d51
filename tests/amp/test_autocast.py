"""mixprec.autocast semantics: torch.autocast's, plus the policy, module rules and switch."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal, mm_dtype, requires_cuda
from mixprec._src.amp import dispatch as dispatch_module
from mixprec._src.amp import thread_state

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# --- arguments, like torch.autocast --------------------------------------------------


def test_default_dtype_follows_torch() -> None:
    with mixprec.autocast("cpu"):
        assert mm_dtype() is torch.get_autocast_dtype("cpu")
        assert mixprec.is_autocast_enabled("cpu")
        assert mixprec.get_autocast_dtype("cpu") is torch.get_autocast_dtype("cpu")
    assert not mixprec.is_autocast_enabled("cpu")
    assert mm_dtype() is FP32


@pytest.mark.parametrize(("dtype", "expected"), [(BF16, BF16), (FP16, FP16), ("bf16", BF16), ("float16", FP16)])
def test_dtype_argument(dtype: torch.dtype | str, expected: torch.dtype) -> None:
    with mixprec.autocast("cpu", dtype=dtype):
        assert mm_dtype() is expected


def test_decorator() -> None:
    @mixprec.autocast("cpu", dtype=FP16)
    def forward() -> torch.dtype:
        return mm_dtype()

    assert forward() is FP16
    assert forward() is FP16  # reusable
    assert mm_dtype() is FP32


def test_decorated_function_can_recurse() -> None:
    @mixprec.autocast("cpu")
    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + depth(n - 1)

    assert depth(3) == 3
    assert not mixprec.is_autocast_enabled("cpu")


def test_nesting_disable_and_other_dtype() -> None:
    with mixprec.autocast("cpu", dtype=BF16):
        assert mm_dtype() is BF16
        with mixprec.autocast("cpu", enabled=False):
            assert mm_dtype() is FP32
            assert not mixprec.is_autocast_enabled("cpu")
            with mixprec.autocast("cpu", dtype=FP16):
                assert mm_dtype() is FP16
            assert mm_dtype() is FP32
        assert mm_dtype() is BF16
        with mixprec.autocast("cpu", dtype=FP16):
            assert mm_dtype() is FP16
        assert mm_dtype() is BF16


def test_nesting_matches_torch_bitwise() -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    results = {}
    for name, ac in (("torch", torch.autocast), ("mixprec", mixprec.autocast)):
        with ac("cpu", dtype=BF16):
            x = torch.mm(a, b)
            with ac("cpu", enabled=False):
                y = torch.mm(x.float(), b)
                with ac("cpu", dtype=FP16):
                    z = torch.mm(y, a)
        results[name] = (x, y, z)
    assert bitwise_equal(results["torch"], results["mixprec"])


def test_other_device_type_region_does_not_disable_cpu() -> None:
    with mixprec.autocast("cpu"), mixprec.autocast("xpu", enabled=False):
        assert mm_dtype() is BF16


def test_state_restored_when_body_raises() -> None:
    with pytest.raises(KeyError), mixprec.autocast("cpu", dtype=FP16), mixprec.autocast("cpu", enabled=False):
        raise KeyError("boom")
    assert not mixprec.is_autocast_enabled("cpu")
    assert mm_dtype() is FP32
    with mixprec.autocast("cpu", dtype=BF16):
        with pytest.raises(ValueError), mixprec.autocast("cpu", dtype=FP16):
            raise ValueError
        assert mm_dtype() is BF16


def test_state_is_thread_local() -> None:
    seen: dict[str, object] = {}
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        seen["before"] = mm_dtype()
        with mixprec.autocast("cpu", dtype=FP16):
            seen["inside"] = mm_dtype()
            inside.set()
            release.wait(10)
        thread_state._tls.__dict__.clear()

    with mixprec.autocast("cpu", dtype=BF16):
        worker = threading.Thread(target=other_thread)
        worker.start()
        assert inside.wait(10)
        assert mm_dtype() is BF16  # the other thread's fp16 region does not leak here
        release.set()
        worker.join()
    assert seen == {"before": FP32, "inside": FP16}


def test_same_object_cannot_be_entered_twice() -> None:
    region = mixprec.autocast("cpu")
    with region, pytest.raises(RuntimeError, match="already active"), region:
        pass


# --- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device_type": "tpu"}, RuntimeError, "Expected one of cpu, cuda"),  # torch's own errors
        ({"device_type": 3}, ValueError, "Expected `device_type` of type `str`"),
        ({"device_type": "cpu", "dtype": "float8"}, ValueError, "unknown autocast dtype 'float8'; valid names: bf16"),
        ({"device_type": "cpu", "policy": "tpu"}, ValueError, "unknown policy 'tpu'; a policy string is"),
        ({"device_type": "cpu", "policy": "compute=bf16,speed=max"}, ValueError, "valid keys are base, compute"),
        ({"device_type": "cpu", "policy": 3}, TypeError, "policy must be a mixprec.Policy"),
        ({"device_type": "cpu", "dtype": FP16, "policy": "compute=bf16"}, ValueError, "conflicts with policy"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        mixprec.autocast(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_dtype_torch_cannot_compute_in_warns_and_disables_like_torch(dtype: torch.dtype) -> None:
    with pytest.warns(UserWarning, match="Disabling autocast") as caught:
        torch.autocast("cpu", dtype=dtype)
    with pytest.warns(UserWarning, match="Disabling autocast") as ours, mixprec.autocast("cpu", dtype=dtype):
        assert not torch.is_autocast_enabled("cpu")
    assert [str(w.message) for w in ours] == [str(w.message) for w in caught]
    with mixprec.autocast("cpu", dtype=dtype, enabled=False):  # the `dtype=amp_dtype, enabled=use_amp` pattern
        assert mm_dtype() is FP32


def test_banned_op_says_what_to_use_instead() -> None:
    probs, target = torch.rand(4), torch.rand(4)
    with mixprec.autocast("cpu", policy="cuda"), pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        F.binary_cross_entropy(probs, target)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_without_gpu_warns_and_disables_like_torch() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        region = mixprec.autocast("cuda")
    with region:
        assert not mixprec.is_autocast_enabled("cuda")


# --- policy effects --------------------------------------------------------------------


def test_any_policy_on_any_device() -> None:
    x = torch.randn(8)
    with mixprec.autocast("cpu", policy="cuda"):  # CUDA lists on CPU tensors: exp runs in fp32
        assert torch.exp(x.to(BF16)).dtype is FP32
        assert torch.softmax(x.to(BF16), 0).dtype is FP32
    with mixprec.autocast("cpu"):  # CPU lists: exp is not listed
        assert torch.exp(x.to(BF16)).dtype is BF16


def test_output_dtype() -> None:
    layer = nn.Linear(8, 8)
    with mixprec.autocast("cpu", policy="compute=bf16,output=fp32"):
        y = layer(torch.randn(2, 8))
    assert y.dtype is FP32
    # values were computed in bf16: they are bf16-representable
    assert torch.equal(y, y.to(BF16).to(FP32))


def test_user_ops_and_custom_ops_can_be_listed() -> None:
    @mixprec.op
    def scaled_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1)

    @torch.library.custom_op("mixprec_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.randn(4)
    policy = mixprec.get_policy("cpu").add("lower", scaled_dot).add("fp32", double)
    with mixprec.autocast("cpu", policy=policy):
        assert scaled_dot(x, x).dtype is BF16
        assert double(x.to(BF16)).dtype is FP32
    with mixprec.autocast("cpu"):
        assert scaled_dot(x, x).dtype is FP32
        assert double(x.to(BF16)).dtype is BF16


def test_removed_op_is_left_alone() -> None:
    policy = mixprec.get_policy("cpu").remove(torch.mm)
    with mixprec.autocast("cpu", policy=policy):
        assert mm_dtype() is FP32
        assert torch.matmul(torch.randn(2, 2), torch.randn(2, 2)).dtype is BF16


def test_python_composites_are_seen_inside() -> None:
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu"):
        expected = mha(x, x, x)
    with mixprec.autocast("cpu"):
        got = mha(x, x, x)
    assert bitwise_equal(expected, got)


# --- weight-cast cache ---------------------------------------------------------------


def test_weight_cast_cache_is_torchs() -> None:
    # A region is a torch region: torch caches the weight casts and clears them at the outermost exit.
    layer = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    for cache_enabled in (True, False):
        with torch.autocast("cpu", cache_enabled=cache_enabled):
            expected = layer(x)
        with mixprec.autocast("cpu", cache_enabled=cache_enabled):
            assert torch.is_autocast_cache_enabled() is cache_enabled
            got = layer(x)
        assert bitwise_equal(got, expected)


def test_edited_op_shares_one_cast_per_weight_like_torch() -> None:
    # mm through mixprec's kernel (an output dtype registers one for every listed op) against torch's
    # own kernel: both cache the weight's cast, so a weight used twice in a region is cast once and its
    # two gradients are summed in bf16 before the cast's backward widens them.
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    x1, x2 = torch.randn(32, 64), torch.randn(32, 64)

    def grad(region: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weight.grad = None
        with region:
            y = torch.mm(x1, weight) + torch.mm(x2, weight)
        y.float().square().sum().backward()
        return y, weight.grad.clone()  # type: ignore[union-attr]

    expected = grad(torch.autocast("cpu"))
    with mixprec.autocast("cpu", policy="compute=bf16,output=bf16"):
        assert "aten::mm@cpu" in dispatch_module.registered()  # the edited kernel runs, not torch's
    got = grad(mixprec.autocast("cpu", policy="compute=bf16,output=bf16"))
    assert bitwise_equal(got, expected)
    assert not dispatch_module.state().cache  # released at the region's exit
    # Two casts (no cache) would sum the two gradients in fp32 instead: the test tells them apart.
    weight.grad = None
    low = weight.bfloat16(), weight.bfloat16()
    (torch.mm(x1.bfloat16(), low[0]) + torch.mm(x2.bfloat16(), low[1])).float().square().sum().backward()
    assert not bitwise_equal(weight.grad, expected[1])


# --- the global switch -----------------------------------------------------------------


def test_global_switch() -> None:
    mixprec.set_autocast_enabled("cpu", True, dtype=FP16)
    try:
        assert mixprec.is_autocast_enabled("cpu")
        assert mm_dtype() is FP16
        with mixprec.autocast("cpu", enabled=False):
            assert mm_dtype() is FP32
            with pytest.raises(RuntimeError, match="leave that region first"):
                mixprec.set_autocast_enabled("cpu", False)
        mixprec.set_autocast_enabled("cpu", True, dtype=BF16)  # replaces the settings
        assert mm_dtype() is BF16
    finally:
        mixprec.set_autocast_enabled("cpu", False)
    assert not mixprec.is_autocast_enabled("cpu")
    assert mm_dtype() is FP32
    mixprec.set_autocast_enabled("cpu", False)  # off when off: nothing to do


def test_global_switch_cache_follows_optimizer_steps() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    reference = nn.Linear(8, 1)
    reference.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    x = torch.randn(16, 8)
    mixprec.set_autocast_enabled("cpu", True)
    try:
        losses = []
        for _ in range(3):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opts[0].step()
            opts[0].zero_grad()
            losses.append(loss.item())
    finally:
        mixprec.set_autocast_enabled("cpu", False)
    expected = []
    for _ in range(3):
        with mixprec.autocast("cpu"):
            loss = reference(x).float().pow(2).mean()
        loss.backward()
        opts[1].step()
        opts[1].zero_grad()
        expected.append(loss.item())
    assert losses == expected  # no stale bf16 weights after an in-place update


# --- CUDA, when there is one -----------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_cuda_training_step_matches_torch(dtype: torch.dtype) -> None:
    results = []
    for ac in (torch.autocast, mixprec.autocast):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8)).cuda()
        x, y = torch.randn(16, 32, device="cuda"), torch.randint(0, 8, (16,), device="cuda")
        with ac("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    assert bitwise_equal(results[0], results[1])


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_edited_policy_runs_without_grad(mode: str) -> None:
    """Inference with an edited policy: no checkpoint is running, so nothing may refuse it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    policy = mixprec.get_policy("cpu").add("fp32", "exp").keep_modules(nn.LayerNorm)
    with mixprec.autocast("cpu", policy=policy):
        want = model(x).detach()
    with getattr(torch, mode)(), mixprec.autocast("cpu", policy=policy):
        got = model(x)
    assert bitwise_equal(got, want)
