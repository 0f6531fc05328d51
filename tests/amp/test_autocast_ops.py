"""Op-level tests: mixprec's tables against the kernels torch registered, torch's own CPU
autocast lists under mixprec, and every category applied by mixprec's dispatcher kernels."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

import mixprec
from helpers import bitwise_equal
from mixprec import OpCategory
from mixprec._src.amp import dispatch as dispatch_module
from mixprec._src.amp import region as region_module
from mixprec._src.amp import thread_state

DTYPES = [torch.bfloat16, torch.float16]
_LISTS = AutocastCPUTestLists(torch.device("cpu"))


@pytest.mark.parametrize(("device_type", "key"), [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_builtin_tables_are_the_ops_torch_registered(device_type: str, key: str) -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if has(n, key)}
    policy = mixprec.get_policy(device_type)
    assert set(policy.op_table) == registered


def _cases() -> list[Any]:
    cases = []
    for list_name, namespace in (("torch_16", torch), ("nn_16", torch._C._nn), ("torch_fp32", torch),
                                 ("nn_fp32", torch._C._nn)):  # fmt: skip
        for entry in getattr(_LISTS, list_name):
            kwargs = entry[2] if len(entry) > 2 else {}
            cases.append(pytest.param(getattr(namespace, entry[0]), entry[1], kwargs, id=f"{list_name}.{entry[0]}"))
    return cases


# A policy that moves every op on torch's CPU list: while a thread holds it, mixprec's kernels stand in
# for all of torch's, and where no mixprec policy is in force they must do what torch's do.
_EVERY = mixprec.get_policy("cpu")
_EVERY_OP_MOVED = _EVERY.remove(*_EVERY.op_table).add("lower", "exp")


def _call(region: Any, fn: Any, args: Any, kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some list entries are deprecated ops
        with region:
            return fn(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("fn", "args", "kwargs"), _cases())
def test_torch_cpu_lists_under_mixprec_and_under_mixprec_kernels(
    fn: Any, args: Any, kwargs: Any, dtype: torch.dtype
) -> None:
    expected = _call(torch.autocast("cpu", dtype=dtype), fn, args, kwargs)
    assert bitwise_equal(_call(mixprec.autocast("cpu", dtype=dtype), fn, args, kwargs), expected)
    # While another thread holds a region whose policy moves every listed op, mixprec's kernels
    # stand in for torch's: here, with no mixprec policy in force, they must do what torch's do.
    with _held_in_other_thread(_EVERY_OP_MOVED):
        assert any(k.startswith("aten::mm@") for k in dispatch_module.registered())
        got = _call(torch.autocast("cpu", dtype=dtype), fn, args, kwargs)
    assert bitwise_equal(got, expected)


def _promote_cases() -> list[Any]:
    """torch's CPU promote lists: ops autocast must promote (args per dtype), ops that promote by themselves."""
    cases = []
    for name, bf16_args, fp16_args in _LISTS.torch_need_autocast_promote:
        args = {torch.bfloat16: bf16_args, torch.float16: fp16_args}
        cases.append(pytest.param(getattr(torch, name), args, None, id=f"torch_need_autocast_promote.{name}"))
    for list_name, owner in (("torch_expect_builtin_promote", torch), ("methods_expect_builtin_promote", torch.Tensor)):
        for name, bf16_args, fp16_args, out_type in getattr(_LISTS, list_name):
            args = {torch.bfloat16: bf16_args, torch.float16: fp16_args}
            cases.append(pytest.param(getattr(owner, name), args, out_type, id=f"{list_name}.{name}"))
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("fn", "args", "out_type"), _promote_cases())
def test_torch_cpu_promote_lists_under_mixprec_and_under_mixprec_kernels(
    fn: Any, args: Any, out_type: torch.dtype | None, dtype: torch.dtype
) -> None:
    expected = _call(torch.autocast("cpu", dtype=dtype), fn, args[dtype], {})
    if out_type is not None:
        assert expected.dtype is out_type  # what torch's own test expects
    assert bitwise_equal(_call(mixprec.autocast("cpu", dtype=dtype), fn, args[dtype], {}), expected)
    with _held_in_other_thread(_EVERY_OP_MOVED):
        got = _call(torch.autocast("cpu", dtype=dtype), fn, args[dtype], {})
    assert bitwise_equal(got, expected)


IDX = torch.tensor([0, 2])


def test_promote_kernels_cast_where_torchs_do_and_raise_where_torchs_do() -> None:
    # What only autocast's promote does: index_copy of an fp32 source into a bf16 tensor (the op itself
    # refuses mixed dtypes), and cat of fp16 with bf16 under a bf16 region (torch refuses: neither is the
    # widest). Through torch's kernels, then through mixprec's stand-ins for them.
    bf16, fp32 = torch.randn(4, 4).bfloat16(), torch.randn(2, 4)
    with torch.autocast("cpu"):
        expected = torch.index_copy(bf16, 0, IDX, fp32)
    assert expected.dtype is torch.float32
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.index_copy(bf16, 0, IDX, fp32)  # without autocast's promote
    with _held_in_other_thread(_EVERY_OP_MOVED), torch.autocast("cpu"):
        assert "aten::index_copy@cpu" in dispatch_module.registered()
        assert bitwise_equal(torch.index_copy(bf16, 0, IDX, fp32), expected)
        # torch's words are "Unexpected floating ScalarType in at::autocast::prioritize"; mixprec's say why
        with pytest.raises(RuntimeError, match=r"float16 input for an op that promotes .* cast the inputs to one"):
            torch.cat([torch.randn(2).half(), torch.randn(2).bfloat16()])
    with torch.autocast("cpu"), pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
        torch.cat([torch.randn(2).half(), torch.randn(2).bfloat16()])  # torch's own


class _held_in_other_thread:  # noqa: N801 - a context manager
    def __init__(self, policy: mixprec.Policy) -> None:
        self.policy, self.opened, self.release = policy, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with mixprec.autocast("cpu", policy=self.policy):
            self.opened.set()
            self.release.wait(30)
        thread_state._tls.__dict__.clear()

    def __enter__(self) -> None:
        self.thread.start()
        assert self.opened.wait(30)

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join()


def test_built_in_policies_register_nothing() -> None:
    for policy in ("cpu", None, mixprec.get_policy("cpu").keep_modules(torch.nn.LayerNorm)):
        with mixprec.autocast("cpu", policy=policy):
            torch.mm(torch.randn(2, 2), torch.randn(2, 2))
            assert dispatch_module.registered() == []


def test_kernels_live_only_while_a_region_needs_them() -> None:
    policy = mixprec.get_policy("cpu").add("fp32", "mm")
    with mixprec.autocast("cpu", policy=policy):
        with mixprec.autocast("cpu", policy=policy):
            assert "aten::mm@cpu" in dispatch_module.registered()
        assert "aten::mm@cpu" in dispatch_module.registered()
    assert dispatch_module.registered() == []
    with torch.autocast("cpu"):  # torch's own kernel is back
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.bfloat16


A, B = torch.randn(4, 4), torch.randn(4, 4)


@pytest.mark.parametrize(
    ("edit", "call", "expected"),
    [
        (("fp32", "mm"), lambda: torch.mm(A, B), torch.float32),  # a listed op moved out of lower
        (("fp32", "exp"), lambda: torch.exp(A.bfloat16()), torch.float32),  # an unlisted op added
        (("lower", "exp"), lambda: torch.exp(A), torch.bfloat16),
        (("lower", "mse_loss"), lambda: torch.nn.functional.mse_loss(A, B), torch.bfloat16),
        # index_add, unlike add, refuses mixed dtypes by itself: only the promote edit makes it run
        (("promote", "index_add"), lambda: torch.index_add(A.bfloat16(), 0, IDX, B[:2]), torch.float32),
        (("promote", "index_add"), lambda: torch.index_add(A.bfloat16(), 0, IDX, B[:2].bfloat16()), torch.bfloat16),
        (("fp32_set_dtype", "softmax"), lambda: torch.softmax(A.bfloat16(), 0), torch.float32),
        (("fp32_set_dtype", "softmax"), lambda: torch.softmax(A.bfloat16(), 0, dtype=torch.bfloat16), torch.bfloat16),
        (("none", "mm"), lambda: torch.mm(A, B), torch.float32),
        (("none", "mm"), lambda: A @ B, torch.bfloat16),  # matmul is its own op on torch's list
    ],
)
def test_edited_categories(edit: tuple[str, str], call: Any, expected: torch.dtype) -> None:
    category, op = edit
    base = mixprec.get_policy("cpu")
    policy = base.remove(op) if category == "none" else base.add(category, op)

    def outcome() -> Any:  # the result, or torch's refusal (index_add of mixed dtypes without the edit)
        try:
            return call()
        except RuntimeError as error:
            return str(error)

    with torch.autocast("cpu"):
        before = outcome()
    with mixprec.autocast("cpu", policy=policy):
        assert call().dtype is expected
    with torch.autocast("cpu"):  # the edit is gone with the region
        assert bitwise_equal(outcome(), before)


def test_edited_op_casts_like_torchs_kernel_bitwise() -> None:
    # mm moved to lower under a policy that lists it anyway through an output dtype: same bits as torch
    x, w = torch.randn(8, 16), torch.randn(16, 4, requires_grad=True)
    with torch.autocast("cpu"):
        expected = torch.mm(x, w)
    with mixprec.autocast("cpu", policy="compute=bf16,output=bf16"):
        assert "aten::mm@cpu" in dispatch_module.registered()
        got = torch.mm(x, w)
    assert bitwise_equal(got, expected)


def test_output_dtype_casts_lower_outputs() -> None:
    with mixprec.autocast("cpu", policy="compute=bf16,output=fp32"):
        assert torch.mm(A, B).dtype is torch.float32
        assert torch.nn.functional.linear(A, B).dtype is torch.float32


def test_banned_op_raises_the_policy_message() -> None:
    policy = mixprec.get_policy("cpu").add(OpCategory.BANNED, "exp", hint="use exp2 instead")
    with mixprec.autocast("cpu", policy=policy), pytest.raises(RuntimeError, match="use exp2 instead"):
        torch.exp(A)


def test_out_and_inplace_variants_behave_as_torch() -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    for policy in ("cpu", mixprec.get_policy("cpu").add("fp32", "addmm").add("lower", "exp")):
        for dtype in DTYPES:
            out_torch, out_mixprec = torch.empty(8, 8), torch.empty(8, 8)
            with torch.autocast("cpu", dtype=dtype):
                torch.mm(a, b, out=out_torch)
                inplace_torch = a.clone().addmm_(a, b), a.clone().exp_()
            with mixprec.autocast("cpu", dtype=dtype, policy=policy):
                torch.mm(a, b, out=out_mixprec)
                inplace_mixprec = a.clone().addmm_(a, b), a.clone().exp_()
            assert bitwise_equal(out_torch, out_mixprec)
            assert bitwise_equal(inplace_torch, inplace_mixprec)


def test_only_floating_non_fp64_tensors_are_cast() -> None:
    a64, b64 = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    ints = torch.arange(4)
    policy = mixprec.get_policy("cpu").add("lower", "add").add("fp32", "mul")
    with mixprec.autocast("cpu", policy=policy):
        assert torch.add(a64, b64).dtype is torch.float64
        assert torch.add(ints, ints).dtype is torch.int64
        assert torch.mul(ints, ints).dtype is torch.int64
        assert torch.add(A, B).dtype is torch.bfloat16


def test_fp32_set_dtype_edit_passes_fp32_unless_the_caller_chose() -> None:
    """torch's fp32_set_opt_dtype, on CPU where torch's list has no such op: dtype=fp32 is added
    only when the caller gave none and the first argument is eligible."""
    x = torch.randn(6, 5)
    policy = mixprec.get_policy("cpu").add("fp32_set_dtype", "softmax", "cumsum")
    with mixprec.autocast("cpu", policy=policy):
        low = x.bfloat16()
        cases = {
            "added": (torch.softmax(low, 0), torch.softmax(low, 0, dtype=torch.float32)),
            "positional": (torch.softmax(low, 1, torch.float64), torch.softmax(low.double(), 1)),
            "keyword": (torch.cumsum(low, 0, dtype=torch.float64), torch.cumsum(low.double(), 0)),
            "fp64 input": (torch.softmax(x.double(), 0), torch.softmax(x.double(), 0)),
        }
    with torch.autocast("cpu", enabled=False):
        want = {k: v[1] for k, v in cases.items()}
    for key, (got, _) in cases.items():
        assert got.dtype is want[key].dtype and bitwise_equal(got, want[key]), key


def test_edited_ops_keep_their_keyword_arguments() -> None:
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    policy = mixprec.get_policy("cpu").add("fp32", "scaled_dot_product_attention", "cumsum")
    with mixprec.autocast("cpu", policy=policy):
        scaled = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
        summed = torch.cumsum(q.bfloat16(), 0, dtype=torch.float64)
    with torch.autocast("cpu", enabled=False):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert bitwise_equal(scaled, want)
    assert not bitwise_equal(scaled, torch.nn.functional.scaled_dot_product_attention(q, k, v))  # scale reached it
    assert summed.dtype is torch.float64
    # an op taken out of every category, and one moved to promote, pass their keyword arguments on too
    a, b, c = torch.randn(4, 4), torch.randn(4, 4).bfloat16(), torch.randn(4, 4).bfloat16()
    other = mixprec.get_policy("cpu").remove("scaled_dot_product_attention").add("promote", "addcmul")
    with mixprec.autocast("cpu", policy=other):
        unlisted = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
        promoted = torch.addcmul(a, b, c, value=0.5)
    assert bitwise_equal(unlisted, want)
    assert bitwise_equal(promoted, torch.addcmul(a, b.float(), c.float(), value=0.5))


def test_output_dtype_casts_each_floating_output_of_a_tuple() -> None:
    x = torch.randn(5, 7)
    policy = mixprec.get_policy("compute=bf16,output=fp32").add("lower", "max")
    with mixprec.autocast("cpu", policy=policy):
        values, indices = torch.max(x, 1)
    want_values, want_indices = torch.max(x.bfloat16(), 1)
    assert values.dtype is torch.float32 and bitwise_equal(values, want_values.float())
    assert indices.dtype is torch.int64 and torch.equal(indices, want_indices)


# --- torch's OpInfo database, for the listed ops (slow) ------------------------------------


def _listed_opinfos() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    listed = set(mixprec.get_policy("cpu").op_table)
    found = []
    for info in op_db:
        aten = getattr(info, "aten_name", None) or info.name.split(".")[-1]
        if aten in listed or info.name.split(".")[-1] in listed:
            found.append(
                pytest.param(info, id=info.name + (f".{info.variant_test_name}" if info.variant_test_name else ""))
            )
    return found


def _flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("info", _listed_opinfos())
def test_opinfo_samples_through_mixprec_stand_in_kernels(info: Any, dtype: torch.dtype) -> None:
    """More shapes than torch's test lists: each listed op's OpInfo samples, with and without
    mixprec's stand-in kernels registered (by a region held open in another thread)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=False))[:4]

    def run() -> list[Any]:
        results = []
        for sample in samples:
            torch.manual_seed(0)
            try:
                results.append(
                    _call(torch.autocast("cpu", dtype=dtype), info.op, (sample.input, *sample.args), sample.kwargs)
                )
            except Exception as error:  # torch itself rejects some samples under autocast
                results.append(type(error).__name__)
        return results

    expected = run()
    every = mixprec.get_policy("cpu")
    stand_ins = every.remove(*every.op_table).add("lower", "exp")
    with _held_in_other_thread(stand_ins):
        got = run()
    torch_runs = [run() for _ in range(3)]  # torch's own spread, for the samples it does not repeat bitwise
    for index, (e, g) in enumerate(zip(expected, got, strict=True)):
        if isinstance(e, str):
            assert e == g
            continue
        if bitwise_equal(_flatten(e), _flatten(g)):
            continue
        others = [_flatten(r[index]) for r in torch_runs]
        if all(bitwise_equal(_flatten(e), o) for o in others):
            # torch repeated itself four times; a kernel that differs does so every time, while an op that is
            # only rarely not reproducible (linalg.lstsq on some CPUs) gives torch's result again
            with _held_in_other_thread(stand_ins):
                again = [run()[index] for _ in range(3)]
            assert any(bitwise_equal(_flatten(e), _flatten(a)) for a in again), (
                f"{info.name}: torch repeats, mixprec differs"
            )
            continue
        # torch is not bitwise reproducible here (linalg.lstsq, some CPUs): as close as torch is to itself
        for want, have, *repeats in zip(_flatten(e), _flatten(g), *others, strict=True):
            assert want.dtype == have.dtype, info.name
            if want.numel():
                spread = max(float((want.double() - r.double()).abs().max()) for r in repeats)
                assert float((want.double() - have.double()).abs().max()) <= 4 * spread + 1e-6, info.name


# --- the AutocastCUDA key, without a GPU ------------------------------------------------------------------

CUDA_OPS = {  # each op's call on a fake CUDA tensor, and its category on torch's CUDA list
    "mm": (lambda x: torch.mm(x, x), torch.float16),
    "addmm": (lambda x: torch.addmm(x, x, x), torch.float16),
    "exp": (lambda x: torch.exp(x.half()), torch.float32),
    "softmax": (lambda x: torch.softmax(x.half(), 0), torch.float32),
    "mse_loss": (lambda x: torch.nn.functional.mse_loss(x.half(), x), torch.float32),
    "addcmul": (lambda x: torch.addcmul(x.half(), x, x), torch.float32),  # promote
}


def test_kernels_at_the_autocast_cuda_key_on_fake_cuda_tensors() -> None:
    # Fake tensors on a "cuda" device reach the AutocastCUDA key on a CPU-only machine: torch's CUDA
    # kernels run there, and mixprec's, registered at that key, stand in for them and apply edits.
    from torch._subclasses import FakeTensorMode

    cuda = mixprec.get_policy("cuda")
    moved = cuda.remove(*CUDA_OPS).add("lower", "exp").add("fp32", "mm")  # type: ignore[arg-type]
    outside = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        x = torch.empty(4, 4, device="cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.float16)
        try:
            torchs = {name: call(x).dtype for name, (call, _) in CUDA_OPS.items()}
            assert torchs == {name: dtype for name, (_, dtype) in CUDA_OPS.items()}
            keys = dispatch_module.acquire(moved, "cuda")  # registered, in force in no thread: stand-ins
            try:
                assert "aten::mm@cuda" in dispatch_module.registered()
                assert {name: call(x).dtype for name, (call, _) in CUDA_OPS.items()} == torchs
                region_module.push("cuda", moved, None)  # in force here: the edits apply
                try:
                    got = {name: call(x).dtype for name, (call, _) in CUDA_OPS.items()}
                finally:
                    region_module.pop()
            finally:
                dispatch_module.release(keys)
        finally:
            torch.set_autocast_enabled("cuda", outside[0])
            torch.set_autocast_dtype("cuda", outside[1])
    # mm moved to fp32; exp lowered; the ops removed from the lists run as their inputs are
    assert got == {"mm": torch.float32, "addmm": torch.float32, "exp": torch.float16, "softmax": torch.float16,
                   "mse_loss": torch.float32, "addcmul": torch.float32}  # fmt: skip
    assert dispatch_module.registered() == []
