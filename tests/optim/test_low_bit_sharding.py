"""Quantized and bf16 optimizer state under FSDP2 (fully_shard) on real gloo process groups: sharded per rank,
trained as one process trains it within the quantization's noise, resumed from DCP bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import full_params, init_process_group, spawn
from mixprec.bench.workloads import TinyLM

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS, SAVE_AT, BATCH = 4, 2, 8


def _lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab=256, dim=64, layers=2, heads=4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (BATCH, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _build(world: int, precision: str, level: str = "bf16-pure") -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _lm()
    if world > 1:
        for layer in model.blocks.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return mixprec.prepare(model, optimizer, level, optimizer_state=precision)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = (t.chunk(world)[rank] for t in _batch(step))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _worker(rank: int, world: int, port: int, results: Any, where: str, level: str, precision: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.filterwarnings("ignore")
    init_process_group(rank, world, port)
    out: dict[str, Any] = {}
    model, optimizer = _build(world, precision, level)
    out["losses"] = _train(model, optimizer, range(STEPS), rank, world)
    out["full"] = full_params(model)
    out["state_bytes"] = mixprec.memory_report(model, optimizer).optimizer_state
    model, optimizer = _build(world, precision, level)
    _train(model, optimizer, range(SAVE_AT), rank, world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
    model, optimizer = _build(world, precision, level)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=where)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    _train(model, optimizer, range(SAVE_AT, STEPS), rank, world)
    out["resumed"] = full_params(model)
    results[rank] = out
    dist.destroy_process_group()


def _one_process(level: str, precision: str) -> dict[str, Any]:
    model, optimizer = _build(1, precision, level)
    losses = _train(model, optimizer, range(STEPS), 0, 1)
    return {"losses": losses, "state_bytes": mixprec.memory_report(model, optimizer).optimizer_state}


@pytest.mark.parametrize(
    ("world", "level", "precision"),
    [
        (2, "bf16-pure", "8bit"),
        pytest.param(2, "bf16-sr", "8bit", marks=pytest.mark.slow),
        pytest.param(4, "bf16-pure", "8bit", marks=pytest.mark.slow),
        (2, "O2", "bf16"),
        pytest.param(4, "bf16-sr", "bf16", marks=pytest.mark.slow),
    ],
)
def test_quantized_state_is_sharded_trains_as_one_process_and_resumes_from_dcp_bitwise(
    world: int, level: str, precision: str, tmp_path: Path
) -> None:
    one_process = _one_process(level, precision)
    ranks = spawn(_worker, world, str(tmp_path), level, precision)
    for rank in ranks:  # each rank holds its shard's codes and scales: a world's share, and the padding of its blocks
        assert rank["state_bytes"] <= one_process["state_bytes"] / world * 1.05
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["resumed"], ranks[0]["full"], strict=True))
    # Blocks follow the shards, so a shard's values share scales with other values than in one process:
    # within the noise of the reduction order, as fp32 state is (measured: 2 ranks, 6 steps, <= 0.006%).
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(one_process["losses"]), rtol=1e-3, atol=0)
