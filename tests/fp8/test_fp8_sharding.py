"""fp8 and block-scaled linears under FSDP2 (fully_shard) on a real gloo group of 2 ranks, against one process.

The bench's transformer LM with fp8 (or MXFP8, NVFP4) linears at O2: training matches one process on the whole
batch, delayed scaling's amax histories are the same on every rank (all-reduced at each step,
so DCP's one saved copy is every rank's), and a DCP checkpoint resumes bit for bit (NVFP4's stochastic
rounding included: its noise counter is a buffer the checkpoint holds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec
from helpers import bitwise_equal, init_process_group, spawn, train_next_token
from mixprec.bench.workloads import TinyLM

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")]

RECIPES = ("tensorwise", "delayed", "tensorwise-all-gather", "delayed-all-gather", "mxfp8", "nvfp4")
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
    name, _, gather = recipe.partition("-")
    gather_fp8 = bool(gather) and world > 1  # one process: the same recipe, nothing to gather
    options: dict[str, Any] = {"delayed": {"history_len": 8}, "nvfp4": {"keep_last": 0.0}}.get(name, {})
    config = mixprec.Fp8Config(name, all_gather=gather_fp8, **options)
    mixprec.prepare(model, opt, "O2", fp8=config)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> list[float]:
    return train_next_token(model, opt, steps, rank, world, batch=BATCH)


def _histories(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("fp8.history")}


def _noise(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("fp8.noise")}


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _gathered_weight_is_the_full_weights_fp8(model: nn.Module, rank: int, world: int) -> bool:
    """The weight a layer's forward sees, cast to e4m3 with its own amax, is the fp32 weight's cast with its own."""
    from mixprec._src.fp8 import gemm as fp8_gemm

    layer = model.blocks.layers[0].linear1  # type: ignore[union-attr,index]
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().float().clone()))
    model(torch.randint(0, 64, (2, 16)))
    handle.remove()
    full = layer.weight.full_tensor().float() if world > 1 else layer.weight.detach().float()

    def fp8(t: torch.Tensor) -> torch.Tensor:
        scale = fp8_gemm.scale_from_amax(t.abs().amax(), torch.float8_e4m3fn, power_of_two=False)
        return fp8_gemm.quantize(t, scale, torch.float8_e4m3fn).float()

    return bool(torch.equal(fp8(seen[0]), fp8(full)))


def _worker(rank: int, world: int, port: int, results: Any, where: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    init_process_group(rank, world, port)
    out: dict[str, Any] = {}
    for recipe in RECIPES:
        model, opt = _build(recipe, world)
        same_fp8 = _gathered_weight_is_the_full_weights_fp8(model, rank, world)
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
        gathered = {fp._module_info.param_name: fp.all_gather_outputs[0].dtype
                    for unit in mixprec._src.sharding.fsdp_units(model) for fp in unit.fsdp_params
                    if hasattr(fp._module_info.module, "fp8")}  # fmt: skip
        out[recipe] = {"losses": losses, "histories": _histories(model), "full": _full(model), "gathered": gathered,
                       "noise": _noise(model), "resumed_noise": _noise(resumed),
                       "same_fp8": same_fp8, "resumed": _full(resumed), "resumed_histories": _histories(resumed),
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
    layers = ("self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2")
    assert ranks[0][recipe]["converted"] == [f"blocks.layers.{i}.{layer}" for i in range(2) for layer in layers]
    assert sharded[-1] < sharded[0]
    assert max(abs(a - b) / b for a, b in zip(sharded, single, strict=True)) < 0.02, (sharded, single)


@pytest.mark.parametrize("recipe", ["tensorwise-all-gather", "delayed-all-gather"])
def test_fp8_all_gather_moves_bytes_and_trains_as_the_bf16_gather(recipe: str, ranks: list[dict[str, Any]]) -> None:
    got, plain = ranks[0][recipe], ranks[0][recipe.removesuffix("-all-gather")]
    assert got["gathered"] == {
        "weight": torch.uint8,
        "bias": torch.bfloat16,
    }  # weights in fp8 bytes, biases in O2's bf16
    assert plain["gathered"] == {"weight": torch.bfloat16, "bias": torch.bfloat16}
    assert got["same_fp8"] and ranks[1][recipe]["same_fp8"]  # one scale across the shards: the whole weight's
    # The same fp8 weights, but cast from the fp32 shard rather than from its bf16 copy: close, not equal.
    assert max(abs(a - b) / b for a, b in zip(got["losses"], plain["losses"], strict=True)) < 0.01


@pytest.mark.parametrize("recipe", ["delayed", "delayed-all-gather"])
def test_delayed_histories_agree_across_ranks(recipe: str, ranks: list[dict[str, Any]]) -> None:
    first, second = ranks[0][recipe]["histories"], ranks[1][recipe]["histories"]
    assert first and bitwise_equal(first, second)
    assert all(h[:, :STEPS].all() for h in first.values())  # one entry per optimizer step, none before


@pytest.mark.parametrize("recipe", RECIPES)
def test_dcp_resume_under_fsdp2_is_bitwise(recipe: str, ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert bitwise_equal(rank[recipe]["resumed"], rank[recipe]["full"])
        assert bitwise_equal(rank[recipe]["resumed_histories"], rank[recipe]["histories"])
        assert bitwise_equal(rank[recipe]["resumed_noise"], rank[recipe]["noise"])
    assert bool(ranks[0][recipe]["noise"]) == (recipe == "nvfp4")  # stochastic rounding's counters, saved
