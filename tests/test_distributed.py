"""GradScaler and autocast across real torch.distributed process groups (gloo, 2 processes on CPU)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixprec

WORLD = 2
STEPS = 6
POISONED_STEP = 2

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def _spawn(fn: Any, *args: Any) -> list[dict[str, Any]]:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(fn, args=(_free_port(), results, *args), nprocs=WORLD, start_method="spawn", join=True)
    return [dict(results[rank]) for rank in range(WORLD)]


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


# --- sharded gradients: each rank owns different parameters ------------------------------


def _sharded(rank: int, port: int, results: Any, use_group: bool) -> None:
    _init(rank, port)
    torch.manual_seed(100 + rank)  # a different shard on every rank
    shard = nn.Linear(8, 1)
    opt = torch.optim.SGD(shard.parameters(), lr=0.1)
    group = dist.group.WORLD if use_group else None
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, process_group=group)
    scales, skipped = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(shard(x).float(), y)
        scaler.scale(loss).backward()
        if step == POISONED_STEP and rank == 1:
            shard.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(scaler.skipped(opt))
    results[rank] = {"scales": scales, "skipped": skipped}
    dist.destroy_process_group()


def test_sharded_overflow_on_one_rank_skips_on_every_rank() -> None:
    together = _spawn(_sharded, True)
    assert together[0] == together[1]  # same scale trajectory, same skips
    assert together[0]["skipped"][POISONED_STEP] and not any(
        s for i, s in enumerate(together[0]["skipped"]) if i != POISONED_STEP
    )
    apart = _spawn(_sharded, False)  # without the group the ranks disagree: why the option exists
    assert apart[0]["skipped"][POISONED_STEP] is False and apart[1]["skipped"][POISONED_STEP] is True
    assert apart[0]["scales"] != apart[1]["scales"]


# --- DDP ----------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))


def _ddp(rank: int, port: int, results: Any, poison: bool, level: str | None) -> None:
    _init(rank, port)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if level is not None:  # prepare first, then wrap: DDP's buckets must see the low-precision weights
        model, opt = mixprec.prepare(model, opt, level=level, keep_types=())
    ddp = DistributedDataParallel(model)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, process_group=dist.group.WORLD if poison else None,
                                enabled=level in (None, "O2"))  # fmt: skip
    for step in range(STEPS):
        x, y = _batch(step, 8 * WORLD)
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if poison and step == POISONED_STEP and rank == 1:
            # After DDP's all-reduce: only this rank sees the bad value (a corrupted local copy).
            next(iter(mixprec.master_params(opt))).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
    params = [p.detach().float().clone() for p in mixprec.master_params(opt)]
    results[rank] = {"params": params}
    dist.destroy_process_group()


def test_ddp_overflow_on_one_rank_keeps_ranks_bitwise_identical() -> None:
    ranks = _spawn(_ddp, True, None)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)


def _single_process(level: str | None) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if level is not None:
        model, opt = mixprec.prepare(model, opt, level=level, keep_types=())
    for step in range(STEPS):
        x, y = _batch(step, 8 * WORLD)
        opt.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.mse_loss(out.float(), y).backward()
        opt.step()
    return [p.detach().float() for p in mixprec.master_params(opt)]


@pytest.mark.parametrize("level", [None, "O2", "bf16-sr", "bf16-pure"])
def test_ddp_matches_one_process_on_the_concatenated_batch(level: str | None) -> None:
    ranks = _spawn(_ddp, False, level)
    single = _single_process(level)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # DDP keeps replicas identical
    # bf16 weights (bf16-pure) round every update: a looser tolerance there
    tolerance = 2e-2 if level in ("bf16-pure", "bf16-sr") else 1e-3
    for ddp_param, single_param in zip(ranks[0]["params"], single, strict=True):
        torch.testing.assert_close(ddp_param, single_param, rtol=tolerance, atol=tolerance)


# --- FSDP2 (fully_shard) ------------------------------------------------------------------


def _fsdp2(rank: int, port: int, results: Any, use_group: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, process_group=dist.group.WORLD if use_group else None)
    skipped = []
    for step in range(STEPS):
        x, y = _batch(step, 8 * WORLD)
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        if step == POISONED_STEP and rank == 1:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.skipped(opt))
    results[rank] = {
        "skipped": skipped,
        "params": [p.full_tensor().detach().clone() for p in model.parameters()],  # type: ignore[attr-defined]
        "sharded": type(next(model.parameters())).__name__,
    }
    dist.destroy_process_group()


@pytest.mark.parametrize("use_group", [True, False], ids=["process_group", "no_group"])
def test_fsdp2_overflow_in_one_shard_skips_on_every_rank(use_group: bool) -> None:
    ranks = _spawn(_fsdp2, use_group)
    assert ranks[0]["sharded"] == "DTensor"
    expected = [i == POISONED_STEP for i in range(STEPS)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == expected
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
