"""The torchtitan arrangement on a real gloo group of 2 ranks: per-block compile, per-block fully_shard,
activation checkpointing, fp8 linears with FSDP2's all-gather in fp8, O2 master weights, DCP resume.

As torchtitan builds it: each block is compiled whole (``torch.compile(block, fullgraph=True)``, its
activation checkpoint inside) and the compiled block is the FSDP2 unit, then the root; the optimizer is
built and ``mixprec.prepare`` runs last. Compiled with ``aot_eager`` (AOTAutograd without a code
generator), training is the eager arrangement's bit for bit, no block compiles again after the first
step, and a DCP checkpoint taken at step 2 resumes the compiled run bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from helpers import bitwise_equal, init_process_group, spawn, train_next_token

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")]

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 8
STEPS, SAVE_AT = 5, 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)  # kept in fp32 (prepare's default)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False)  # type: ignore[no-any-return]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def _build(backend: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    for i, block in enumerate(model.layers):
        if backend is not None:
            block = torch.compile(block, fullgraph=True, backend=backend)
            model.layers[i] = block
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O2", fp8=mixprec.Fp8Config("tensorwise", all_gather=True))
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int,
           frames: list[int] | None = None, counter: Any = None) -> list[float]:  # fmt: skip
    after_step = None if frames is None else lambda: frames.append(counter.frame_count)
    return train_next_token(model, opt, steps, rank, world, vocab=VOCAB, seq=SEQ, batch=BATCH, after_step=after_step)


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[operator]


def _worker(rank: int, world: int, port: int, results: Any, where: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    init_process_group(rank, world, port)
    torch._dynamo.reset()
    eager, eager_opt = _build(None)
    out: dict[str, Any] = {"eager": _train(eager, eager_opt, range(STEPS), rank, world), "eager_full": _full(eager)}

    counter = CompileCounterWithBackend("aot_eager")
    model, opt = _build(counter)
    frames: list[int] = []
    losses = _train(model, opt, range(SAVE_AT), rank, world, frames, counter)
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=Path(where))
    losses += _train(model, opt, range(SAVE_AT, STEPS), rank, world, frames, counter)
    out.update(compiled=losses, frames=frames, compiled_full=_full(model),
               converted=mixprec.fp8_layers(model).converted)  # type: ignore[union-attr]  # fmt: skip

    resumed, resumed_opt = _build(counter)
    model_state, opt_state = get_state_dict(resumed, resumed_opt)
    state = {"model": model_state, "optim": opt_state}
    dcp.load(state, checkpoint_id=Path(where))
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["resumed"] = _train(resumed, resumed_opt, range(SAVE_AT, STEPS), rank, world)
    out["resumed_full"] = _full(resumed)
    results[rank] = out
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_worker, 2, str(tmp_path_factory.mktemp("titan")))


def test_every_block_is_an_fp8_unit_compiled_once(ranks: list[dict[str, Any]]) -> None:
    assert len(ranks[0]["converted"]) == 4  # both linears of both blocks (the head stays out by rule)
    frames = ranks[0]["frames"]
    assert frames[0] == 2 and frames == [2] * STEPS, frames  # one graph per block, none compiled again


def test_compiled_trains_as_the_eager_arrangement(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["compiled"] == rank["eager"]
        assert bitwise_equal(rank["compiled_full"], rank["eager_full"])


def test_dcp_resume_of_the_compiled_run_is_bitwise(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["resumed"] == rank["compiled"][SAVE_AT:]
        assert bitwise_equal(rank["resumed_full"], rank["compiled_full"])
