"""GradScaler, autocast and prepare levels under DDP and hand-sharded gradients (gloo, 2 processes on CPU).

Each group of tests spawns one process group and runs all its cases there; FSDP2 is in test_sharding.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixprec
from helpers import init_process_group, spawn

WORLD = 2
STEPS = 6
POISONED_STEP = 2
LEVELS = (None, "O2", "bf16-sr", "bf16-pure")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


# --- sharded gradients: each rank owns different parameters ------------------------------


def _sharded_run(rank: int, use_group: bool) -> dict[str, Any]:
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
    return {"scales": scales, "skipped": skipped}


def _sharded_worker(rank: int, world: int, port: int, results: Any) -> None:
    init_process_group(rank, world, port)
    results[rank] = {"together": _sharded_run(rank, True), "apart": _sharded_run(rank, False)}
    dist.destroy_process_group()


def test_sharded_overflow_on_one_rank_skips_on_every_rank() -> None:
    ranks = spawn(_sharded_worker, WORLD)
    together = [r["together"] for r in ranks]
    assert together[0] == together[1]  # same scale trajectory, same skips
    assert together[0]["skipped"][POISONED_STEP] and not any(
        s for i, s in enumerate(together[0]["skipped"]) if i != POISONED_STEP
    )
    apart = [r["apart"] for r in ranks]  # without the group the ranks disagree: why the option exists
    assert apart[0]["skipped"][POISONED_STEP] is False and apart[1]["skipped"][POISONED_STEP] is True
    assert apart[0]["scales"] != apart[1]["scales"]


# --- DDP ----------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))


def _ddp_run(rank: int, level: str | None, *, poison: bool = False, no_sync: bool = False,
             torch_bf16: bool = False) -> list[torch.Tensor]:  # fmt: skip
    model = _model()
    if torch_bf16:  # torch's own: a bf16 model
        model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if level is not None:  # prepare first, then wrap
        model, opt = mixprec.prepare(model, opt, level=level, keep_types=())
    ddp = DistributedDataParallel(model)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, process_group=dist.group.WORLD if poison else None,
                                enabled=level in (None, "O2"))  # fmt: skip
    for step in range(STEPS):
        x, y = _batch(step, 8 * WORLD)
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        micro = [(x, y)] if not no_sync else list(zip(x.chunk(2), y.chunk(2), strict=True))
        for i, (xm, ym) in enumerate(micro):
            # all micro-batches but the last accumulate locally, without DDP's all-reduce
            context = ddp.no_sync() if i < len(micro) - 1 else torch.enable_grad()
            with context:
                with mixprec.autocast("cpu", dtype=torch.bfloat16):
                    out = ddp(xm)
                scaler.scale(F.mse_loss(out.float(), ym) / len(micro)).backward()
        if poison and step == POISONED_STEP and rank == 1:
            # After DDP's all-reduce: only this rank sees the bad value (a corrupted local copy).
            next(iter(mixprec.master_params(opt))).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
    return [p.detach().float().clone() for p in mixprec.master_params(opt)]


def _ddp_worker(rank: int, world: int, port: int, results: Any) -> None:
    init_process_group(rank, world, port)
    out: dict[str, Any] = {"poisoned": _ddp_run(rank, None, poison=True)}
    for no_sync in (False, True):  # torch's own DDP on a bf16 model: the bf16 levels' tolerance
        out["torch-bf16" + ("/no_sync" if no_sync else "")] = _ddp_run(rank, None, no_sync=no_sync, torch_bf16=True)
    for level in LEVELS:
        out[str(level)] = _ddp_run(rank, level)
        out[f"{level}/no_sync"] = _ddp_run(rank, level, no_sync=True)
    results[rank] = out
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_ranks() -> list[dict[str, Any]]:
    return spawn(_ddp_worker, WORLD)


def test_ddp_overflow_on_one_rank_keeps_ranks_bitwise_identical(ddp_ranks: list[dict[str, Any]]) -> None:
    for a, b in zip(ddp_ranks[0]["poisoned"], ddp_ranks[1]["poisoned"], strict=True):
        assert torch.equal(a, b)


def _single_process(level: str | None, torch_bf16: bool = False) -> list[torch.Tensor]:
    model = _model()
    if torch_bf16:
        model = model.to(torch.bfloat16)
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


@pytest.mark.parametrize("accumulation", ["", "/no_sync"], ids=["one-batch", "no_sync-accumulation"])
@pytest.mark.parametrize("level", LEVELS)
def test_ddp_matches_one_process_on_the_concatenated_batch(
    level: str | None, accumulation: str, ddp_ranks: list[dict[str, Any]]
) -> None:
    key = f"{level}{accumulation}"
    for a, b in zip(ddp_ranks[0][key], ddp_ranks[1][key], strict=True):
        assert torch.equal(a, b)  # DDP keeps replicas identical
    single = _single_process(level)
    # How far torch's own DDP run (the same accumulation) ends from its one process, at the level's weight
    # dtype, is the tolerance: fp32 weights under autocast (mixprec.autocast's built-in region is torch's),
    # or a bf16 model. bf16 weights round every update: a few bf16 steps apart.
    if level in (None, "O2"):
        pair = ddp_ranks[0][f"None{accumulation}"], _single_process(None)
    else:
        pair = ddp_ranks[0][f"torch-bf16{accumulation}"], _single_process(None, torch_bf16=True)
    torch_gap = max((a - b).abs().max().item() for a, b in zip(*pair, strict=True))
    ours = max((a - b).abs().max().item() for a, b in zip(ddp_ranks[0][key], single, strict=True))
    # plus one rounding step of the largest weight: where torch's run happens to land on the same value
    largest = max(p.abs().max().item() for p in single)
    step = largest * (2.0**-7 if level in ("bf16-pure", "bf16-sr") else 2.0**-23)
    assert ours <= 1.5 * torch_gap + step, (ours, torch_gap)
