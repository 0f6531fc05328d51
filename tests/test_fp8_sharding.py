"""fp8 linears under FSDP2 (fully_shard) on a real gloo group of 2 ranks, against one process.

The bench's transformer LM with fp8 MLP linears at O2: training matches one process on the whole
batch, delayed scaling's amax histories are the same on every rank (all-reduced at each step,
so DCP's one saved copy is every rank's), and a DCP checkpoint resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal, init_process_group, spawn
from mixprec.bench.workloads import TinyLM

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")]

RECIPES = ("tensorwise", "delayed")
STEPS, SAVE_AT, BATCH = 4, 2, 8


def _build(recipe: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM(vocab=64, dim=32, layers=2, heads=2)
    if world > 1:
        for layer in model.blocks.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, "O2", fp8=mixprec.Fp8Config(recipe, history_len=8))
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        tokens = torch.randint(0, 64, (BATCH, 17), generator=torch.Generator().manual_seed(100 + step))
        x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _histories(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("fp8.history")}


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, port: int, results: Any, where: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    init_process_group(rank, world, port)
    out: dict[str, Any] = {}
    for recipe in RECIPES:
        model, opt = _build(recipe, world)
        losses = _train(model, opt, range(SAVE_AT), rank, world)
        model_state, opt_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=Path(where) / recipe)
        losses += _train(model, opt, range(SAVE_AT, STEPS), rank, world)
        resumed, opt2 = _build(recipe, world)
        model_state, opt_state = get_state_dict(resumed, opt2)
        state = {"model": model_state, "optim": opt_state}
        dcp.load(state, checkpoint_id=Path(where) / recipe)
        set_state_dict(resumed, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _train(resumed, opt2, range(SAVE_AT, STEPS), rank, world)
        out[recipe] = {"losses": losses, "histories": _histories(model), "full": _full(model),
                       "resumed": _full(resumed), "resumed_histories": _histories(resumed),
                       "converted": mixprec.fp8_layers(model).converted}  # type: ignore[union-attr]  # fmt: skip
    results[rank] = out
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_worker, 2, str(tmp_path_factory.mktemp("fp8-dcp")))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_under_fsdp2_trains_as_one_process(recipe: str, ranks: list[dict[str, Any]]) -> None:
    model, opt = _build(recipe, 1)
    single = _train(model, opt, range(STEPS), 0, 1)
    sharded = ranks[0][recipe]["losses"]
    assert ranks[0][recipe]["converted"] == ["blocks.layers.0.linear1", "blocks.layers.0.linear2",
                                             "blocks.layers.1.linear1", "blocks.layers.1.linear2"]  # fmt: skip
    assert sharded[-1] < sharded[0]
    assert max(abs(a - b) / b for a, b in zip(sharded, single, strict=True)) < 0.02, (sharded, single)


def test_delayed_histories_agree_across_ranks(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks[0]["delayed"]["histories"], ranks[1]["delayed"]["histories"]
    assert first and bitwise_equal(first, second)
    assert all(h[:, :STEPS].all() for h in first.values())  # one entry per optimizer step, none before


@pytest.mark.parametrize("recipe", RECIPES)
def test_dcp_resume_under_fsdp2_is_bitwise(recipe: str, ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert bitwise_equal(rank[recipe]["resumed"], rank[recipe]["full"])
        assert bitwise_equal(rank[recipe]["resumed_histories"], rank[recipe]["histories"])
