"""mixprec.autocast under torch.compile(fullgraph=True): one graph, no breaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import mixprec
from helpers import bitwise_equal


@pytest.fixture(autouse=True)
def _reset_dynamo() -> None:
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="module")
def _rule_hooks_removed() -> Any:
    """A region with rules traced by a compile leaves the global module hooks installed (its frame's guards read
    them); the next eager region with rules removes them. Done here, so a later module's ``torch.compile(module)``
    runs without torch's warning about global hooks."""
    yield
    with mixprec.autocast("cpu", policy=_rules()):
        pass
    assert not nn.modules.module._has_any_global_hook()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))


def test_region_inside_compiled_function_is_one_graph() -> None:
    model, x = _model(), torch.randn(4, 8)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            return out, F.mse_loss(out, torch.zeros(4, 4))

    counter = CompileCounter()
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    got = compiled(x)
    assert counter.frame_count == 1  # fullgraph=True would raise on a break; one graph was made
    assert got[0].dtype is torch.bfloat16 and got[1].dtype is torch.float32
    assert bitwise_equal(got, step(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bitwise_equal(got[0], model(x))


def test_compiled_model_inside_eager_region() -> None:
    model, x = _model(), torch.randn(4, 8)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with mixprec.autocast("cpu"):
        got = compiled(x)
        expected = model(x)
    assert counter.frame_count == 1
    assert bitwise_equal(got, expected)


def _compiled_step(model: nn.Module, x: torch.Tensor, fn: Any) -> Any:
    """The loss and gradients of ``fn(x)`` compiled by inductor."""
    model.zero_grad()
    loss = torch.compile(fn, fullgraph=True)(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_inductor_training_step() -> None:
    model, x = _model(), torch.randn(4, 8)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu"):
            return F.mse_loss(model(x), torch.zeros(4, 4))

    def torch_loss_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu"):
            return F.mse_loss(model(x), torch.zeros(4, 4))

    got = _compiled_step(model, x, loss_fn)
    assert got[0].dtype is torch.float32
    # inductor compiles torch's own region to the same kernels, bit for bit; fp32 rounds otherwise
    assert bitwise_equal(got, _compiled_step(model, x, torch_loss_fn))
    assert not bitwise_equal(got, _compiled_step(model, x, lambda x: F.mse_loss(model(x), torch.zeros(4, 4))))


def _breaks_of_a_scaled_step(scaler_cls: type, autocast: object) -> tuple[int, int]:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu")

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with autocast("cpu", dtype=torch.float16):  # type: ignore[operator]
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    for _ in range(2):
        compiled(torch.randn(4, 8))
    return counter.frame_count, sum(counters["graph_break"].values())


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # Dynamo's own
def test_scaled_training_step_breaks_no_more_than_torch_amp() -> None:
    torch_frames, torch_breaks = _breaks_of_a_scaled_step(torch.amp.GradScaler, torch.autocast)
    frames, breaks = _breaks_of_a_scaled_step(mixprec.GradScaler, mixprec.autocast)
    assert frames <= torch_frames and breaks <= torch_breaks, (frames, breaks, torch_frames, torch_breaks)


@pytest.mark.parametrize("spec", ["cpu", "cuda", "compute=fp16,output=fp32"])
def test_policies_compile_to_one_graph(spec: str) -> None:
    model, x = _model(), torch.randn(4, 8)
    # Built-in names work as strings; other policies are built outside the compiled function.
    policy: str | mixprec.Policy = spec if spec in ("cpu", "cuda") else mixprec.get_policy(spec)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=policy):
            return model(x)

    counter = CompileCounter()
    got = torch.compile(forward, fullgraph=True, backend=counter)(x)
    assert counter.frame_count == 1
    assert bitwise_equal(got, forward(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _rules() -> mixprec.Policy:
    # by name (matched with fnmatch), and by type with another low dtype
    policy = mixprec.get_policy("cpu").keep_modules(names=("head", "blocks.1.fc"))
    return policy.keep_modules(nn.LayerNorm, dtype="fp16")


def _eager_with_rules(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with mixprec.autocast("cpu", policy=_rules()):
        out: torch.Tensor = model(x)
    # the rules did something: without them the head would return bf16
    assert out.dtype is torch.float32
    return out


# The counting backend runs the graph through aot_eager: a plain "eager" backend runs the
# traced graph as Python under the still-active mode, which would cast a second time.
def test_module_rules_in_a_compiled_region_are_one_graph() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    policy = _rules()

    def forward(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=policy):
            return model(x)

    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(forward, fullgraph=True, backend=counter)(x)
    assert counter.frame_count == 1
    assert bitwise_equal(got, _eager_with_rules(model, x))


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # Dynamo's own
def test_compiled_model_with_module_rules_inside_eager_region() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    expected = _eager_with_rules(model, x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for _ in range(2):
        with mixprec.autocast("cpu", policy=_rules()):
            got = compiled(x)
        assert bitwise_equal(got, expected)
    assert counter.frame_count == 1  # the second call reused the graph
    # A compiled submodule of an eager model keeps its qualified name ("blocks.1.fc").
    model.blocks[1] = torch.compile(model.blocks[1], fullgraph=True, backend=counter)  # type: ignore[assignment]
    with mixprec.autocast("cpu", policy=_rules()):
        got = model(x)
    assert bitwise_equal(got, expected)
    assert counter.frame_count == 2  # and one graph for the submodule


def test_module_rules_inductor_training_step() -> None:
    # The rules (norms and the head in fp32) compiled by inductor: the same kernels as torch's region
    # with those modules written out in fp32 by hand, bit for bit; without the rules, another result.
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    policy = mixprec.get_policy("cpu").keep_modules(nn.LayerNorm, names="head")

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=policy):
            return model(x).square().mean()

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu"):
            h = model.inp(x)
            for block in model.blocks:
                h = torch.relu(block.fc(h))
                with torch.autocast("cpu", enabled=False):
                    h = block.norm(h.float())
            with torch.autocast("cpu", enabled=False):
                out = model.head(h.float())
            return out.square().mean()

    def without_rules(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu"):
            return model(x).square().mean()

    got = _compiled_step(model, x, loss_fn)
    assert bitwise_equal(got, _compiled_step(model, x, by_hand))
    assert not bitwise_equal(got, _compiled_step(model, x, without_rules))
