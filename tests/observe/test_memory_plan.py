"""mixprec.memory_plan: what memory_report counts after a step and what the forward saves for backward, predicted
from the shapes alone, byte for byte, on the bench workloads and on config-built Hugging Face models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec._src.prepare.prepare import prepared_state
from mixprec.bench.workloads import WORKLOADS

RECIPES = [
    {"level": "O1"},
    {"level": "O2"},
    {"level": "bf16-sr", "optimizer_state": "8bit"},
    {"level": "bf16-kahan", "optimizer_state": "4bit", "step_in_backward": True},
    {"level": "bf16-pure", "optimizer_state": "fp8"},
]


def _saved_for_backward(model: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors the forward saves for backward, not weights (each storage once): measured."""
    state = prepared_state(model)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    if state is not None and state.copies is not None:
        weights |= {c.untyped_storage()._cdata for c in state.copies.copies.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in weights:
            saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    return sum(saved.values()), loss


def _check(model: nn.Module, optimizer: torch.optim.Optimizer, recipe: dict[str, Any], batch: Any,
           loss_of: Callable[[Any], torch.Tensor]) -> mixprec.MemoryPlan:  # fmt: skip
    config = mixprec.PrepareConfig(**recipe)
    plan = mixprec.memory_plan(model, optimizer, config, batch=batch, loss_fn=loss_of)
    mixprec.prepare(model, optimizer, config)
    call = (lambda: model(**batch)) if isinstance(batch, dict) else (lambda: model(batch))
    measured, loss = _saved_for_backward(model, lambda: loss_of(call()))
    loss.backward()
    optimizer.step()
    report = mixprec.memory_report(model, optimizer)
    assert (plan.parameters, plan.masters, plan.gradients, plan.optimizer_state) == (
        report.parameters, report.masters, report.gradients, report.optimizer_state)  # fmt: skip
    assert plan.activations == measured
    return plan


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: "-".join(str(v) for v in r.values()))
@pytest.mark.parametrize("workload", ["mlp", "transformer", "cnn", "checkerboard"])
def test_the_plan_is_what_memory_report_and_the_forward_hold_on_the_bench_workloads(
    workload: str, recipe: dict[str, Any]
) -> None:
    task = WORKLOADS[workload].build("tiny", torch.device("cpu"))
    x, y = task.batch(0)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    _check(task.model, optimizer, recipe, x, lambda out: task.loss_fn(out.float(), y))


def _hf_models() -> dict[str, tuple[Callable[[], nn.Module], dict[str, torch.Tensor]]]:
    transformers = pytest.importorskip("transformers")
    vocab, tokens = 64, torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    text = {"input_ids": tokens, "labels": tokens}
    return {
        "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)), text),
        "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16)), text),
        "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, pad_token_id=0)), text),
        "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)),
            text),
        "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_labels=5)),
            {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, 5, (4,))}),
    }  # fmt: skip


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit"])
def test_the_plan_is_what_memory_report_and_the_forward_hold_on_hugging_face_models(name: str, level: str) -> None:
    build, batch = _hf_models()[name]
    torch.manual_seed(0)
    model = build().train()  # dropout's masks are saved tensors too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = _check(model, optimizer, {"level": level, "optimizer_state": "8bit"}, batch, lambda out: out.loss)
    assert plan.blocks and plan.activations_checkpointed is not None
    assert plan.activations_checkpointed < plan.activations  # the blocks' own activations, but the largest's


def test_world_size_gives_rank_zeros_shard_and_fp32_is_a_recipe() -> None:
    model = nn.Sequential(nn.Linear(64, 100), nn.Linear(100, 64))  # 100 rows: 34, 33, 33 over three ranks
    optimizer = torch.optim.AdamW(model.parameters())
    whole = mixprec.memory_plan(model, optimizer, "bf16-sr")
    sharded = mixprec.memory_plan(model, optimizer, "bf16-sr", world_size=3)
    first = 34 * 64 + 34 + 22 * 100 + 22  # each parameter's first dim-0 shard
    assert sharded.parameters == 2 * first and whole.parameters == 2 * sum(p.numel() for p in model.parameters())
    fp32 = mixprec.memory_plan(model, optimizer, "fp32")
    params = sum(p.numel() for p in model.parameters())
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_state) == (4 * params, 4 * params, 8 * params + 4 * 4)
    with pytest.raises(ValueError, match="Adam, AdamW and SGD"):
        mixprec.memory_plan(model, torch.optim.Adagrad(model.parameters()), "O2")


def test_the_cli_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec.cli import main

    assert main(["memory-plan", "--workload", "mlp", "--size", "tiny", "--level", "bf16-sr", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["state"] == out["parameters"] + out["masters"] + out["gradients"] + out["optimizer_state"]
    assert out["activations"] > 0 and out["peak"] > out["state"] and out["backward"] > 0
    assert main(["memory-plan", "--workload", "checkerboard", "--size", "tiny", "--level", "bf16-sr"]) == 0
    text = capsys.readouterr().out
    assert "backward, beyond the activations" in text and "checkpointed" not in text  # a Sequential: no blocks


def test_the_peak_holds_what_backward_makes_beyond_the_saved_activations() -> None:
    """A ReLU MLP in fp32, worked by hand: the forward saves the batch and the ReLU's output; backward then holds,
    at its worst op (the ReLU's), the gradients of the ReLU's output and input at once, the last weight's
    gradient and the backward's seed. Stepping in backward (O1), that weight's fp32 gradient is counted in
    flight instead."""
    rows, inputs, hidden = 128, 16, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(inputs, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, 1, bias=False))
    batch = torch.randn(rows, inputs)

    def plan(recipe: Any) -> mixprec.MemoryPlan:
        optimizer = torch.optim.AdamW(model.parameters())
        return mixprec.memory_plan(model, optimizer, recipe, batch=batch, loss_fn=lambda out: out.sum())

    fp32 = plan("fp32")
    assert fp32.activations == 4 * (rows * inputs + rows * hidden)
    assert fp32.backward == 4 * (2 * rows * hidden + hidden + 1)
    assert fp32.peak == max(fp32.state + fp32.transient, fp32.state - fp32.gradients + fp32.activations + fp32.backward)
    after = plan(mixprec.PrepareConfig(level="O1"))
    stepped = plan(mixprec.PrepareConfig(level="O1", step_in_backward=True))
    assert after.backward is not None and stepped.backward is not None
    assert after.backward - stepped.backward == 4 * hidden
    assert stepped.peak == stepped.state + stepped.activations + stepped.backward + stepped.gradients_in_flight + \
        stepped.transient  # fmt: skip


@pytest.mark.parametrize("level", ["fp32", "bf16-pure", "O1"])
def test_backward_on_fake_tensors_makes_what_the_real_one_makes(level: str) -> None:
    """The checkerboard's 1x1 convolutions, batch norms (kept in fp32) and ReLUs: the most bytes backward on fake
    tensors (the plan's) holds beyond the saved ones is what the real backward of the prepared model holds."""
    from mixprec._src.observe import backward_timeline

    task = WORKLOADS["checkerboard"].build("tiny", torch.device("cpu"))
    model, (x, y) = task.model, task.batch(0)
    optimizer = torch.optim.AdamW(model.parameters())
    plan = mixprec.memory_plan(model, optimizer, level, batch=x, loss_fn=lambda out: task.loss_fn(out.float(), y))
    if level != "fp32":
        mixprec.prepare(model, optimizer, level)
    timeline = backward_timeline.BackwardTimeline()
    saved = {backward_timeline.storage_key(p) for p in model.parameters()}  # weights are not saved activations

    def pack(t: torch.Tensor) -> torch.Tensor:
        if backward_timeline.storage_key(t) not in saved:
            saved.add(backward_timeline.storage_key(t))
            timeline.saved(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task.loss_fn(model(x).float(), y)
    grads: dict[int, int | None] = {}
    for p in model.parameters():
        p.register_hook(lambda g, p=p: grads.update({timeline.number(g): p.numel() * p.element_size()}))
    with timeline:
        loss.backward(torch.ones_like(loss))
    for p in model.parameters():
        grads[timeline.number(p.grad)] = p.numel() * p.element_size()
    assert plan.backward == backward_timeline.peak(timeline.events, grads) > 2 * plan.largest_gradient


def test_a_model_on_the_meta_device_plans_as_on_the_cpu() -> None:
    """Too large to build: planned from its shapes, the backward on fakes included."""
    plans = []
    for device in ("meta", "cpu"):
        with torch.device(device):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        optimizer = torch.optim.AdamW(model.parameters())
        loss = lambda out: out.square().mean()  # noqa: E731
        plans.append(mixprec.memory_plan(model, optimizer, "bf16-sr", batch=torch.randn(32, 64), loss_fn=loss))
    assert plans[0] == plans[1] and plans[0].backward
