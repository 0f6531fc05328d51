"""mixprec.memory_plan: what memory_report counts after a step and what the forward saves for backward, predicted
from the shapes alone, byte for byte, on the bench workloads and on config-built Hugging Face models."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mixprec
from helpers import requires_cuda
from mixprec._src.prepare.levels import prepared_state
from mixprec.bench.workloads import WORKLOADS

RECIPES = [
    {"level": "O1"},
    {"level": "O2"},
    {"level": "bf16-sr", "optimizer_state": "8bit"},
    {"level": "bf16-kahan", "optimizer_state": "4bit", "step_in_backward": True},
    {"level": "bf16-pure", "optimizer_state": "fp8"},
    {"level": "O2", "optimizer_state": "bf16"},
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


FP8_RECIPES = [
    {"level": "O2", "fp8": "mxfp8"},
    {"level": "bf16-sr", "fp8": "nvfp4"},
    {"level": "O2", "fp8": "tensorwise"},
]


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=lambda r: "-".join(str(v) for v in r.values()))
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_fp8_and_block_scaled_layers_keep_for_backward_what_the_plan_counts(
    workload: str, recipe: dict[str, Any]
) -> None:
    # a block-scaled layer keeps its input and weight as they came and casts them again in backward (as the
    # fp8 layers do): no codes or scales are kept between the passes, and the plan counts what is. At O2 the
    # attention fp8 conversion routes computes its out_proj on the projection's own copy, not a cast of it
    task = WORKLOADS[workload].build("tiny", torch.device("cpu"))
    x, y = task.batch(0)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    plan = _check(task.model, optimizer, recipe, x, lambda out: task.loss_fn(out.float(), y))
    assert plan.activations > 0


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: "-".join(str(v) for v in r.values()))
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_on_cuda_the_plan_is_what_memory_report_and_the_forward_hold(workload: str, recipe: dict[str, Any]) -> None:
    """The GPU's kernels save other tensors than the CPU's (its attention, its fused losses): planned on the
    model's device, the plan counts the GPU's."""
    task = WORKLOADS[workload].build("tiny", torch.device("cuda"))
    task.model.cuda()
    x, y = task.batch(0)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    _check(task.model, optimizer, recipe, x, lambda out: task.loss_fn(out.float(), y))


IN_BACKWARD = {"optimizer_state": "8bit", "step_in_backward": True}


@requires_cuda
@pytest.mark.parametrize(
    "options",
    [None, {"level": "O2"}, {"level": "bf16-sr", **IN_BACKWARD}, {"level": "bf16-sr", **IN_BACKWARD,
                                                                  "optimizer_state": "4bit"}],
    ids=["fp32", "O2", "8bit-in-backward", "4bit-in-backward"],
)  # fmt: skip
def test_on_cuda_the_planned_peak_is_the_allocators_within_5_percent(options: dict[str, Any] | None) -> None:
    """The caching allocator counts every live tensor's bytes: its peak over training steps (less the data and
    what was allocated before, after a warm-up run that made the libraries' workspaces) is the plan's."""
    cuda = torch.device("cuda")

    def steps(task: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
        config: Any = "fp32" if options is None else mixprec.PrepareConfig(**options)
        plan = mixprec.memory_plan(task.model, optimizer, config, batch=x,
                                   loss_fn=lambda out: task.loss_fn(out.float(), y))  # fmt: skip
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() - sum(p.nbytes for p in task.model.parameters())  # less the fp32 model
        if options is not None:
            mixprec.prepare(task.model, optimizer, config)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            optimizer.zero_grad()
            task.loss_fn(task.model(x).float(), y).backward()
            optimizer.step()
        torch.cuda.synchronize()
        return plan, torch.cuda.max_memory_allocated() - base

    for _ in ("warm-up", "measured"):  # the warm-up makes cuBLAS's workspace and compiles the kernels
        task = WORKLOADS["transformer"].build("quick", cuda)
        task.model.cuda()
        x, y = (t[:4].clone() for t in task.batch(0))
        plan, peak = steps(task, x, y)
        del task
    assert plan.peak is not None
    assert abs(peak - plan.peak) <= 0.05 * plan.peak, (peak, plan.peak, plan)


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
    assert main(["memory-plan", "--workload", "mlp", "--size", "tiny", "--level", "O2", "--optimizer-state", "bf16",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer_state"] < 7 * out["parameter_count"]  # bf16 moments (fp32's: 8 bytes a parameter)


class _NewTensors(TorchDispatchMode):
    """The most bytes of tensors made inside it alive at once (each storage once; ``known`` ones not counted)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.alive: set[int] = set()  # storages made here and not freed yet (an address freed can come again)
        self.live = self.peak = 0

    def _free(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key not in self.known and key not in self.alive:
                    self.alive.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, nbytes)
        return out


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    "adam-l2": lambda ps: torch.optim.Adam(ps, weight_decay=0.1, foreach=False),
    "adam-l2-foreach": lambda ps: torch.optim.Adam(ps, weight_decay=0.1, foreach=True),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, maximize=True, foreach=False),
    "sgd-nesterov-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1,
                                                  foreach=False),
    "sgd-nesterov-wd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1,
                                                          foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd-momentum-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1, foreach=False),
}  # fmt: skip


@pytest.mark.parametrize("recipe", ["fp32", "O1", "O2", "bf16-pure"])
@pytest.mark.parametrize("make", list(OPTIMIZERS))
def test_the_steps_temporaries_are_what_torchs_step_makes(make: str, recipe: Any) -> None:
    """torch's own Adam(W) and SGD, for-loop (its CPU default), foreach (its GPU default: a temporary for every
    tensor of a list at once) and fused: the most bytes the step makes and frees, measured tensor by tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 128), nn.Linear(128, 64))
    optimizer = OPTIMIZERS[make](model.parameters())
    config = recipe if recipe == "fp32" else mixprec.PrepareConfig(level=recipe)
    plan = mixprec.memory_plan(model, optimizer, config)
    if recipe != "fp32":
        mixprec.prepare(model, optimizer, config)
    x = torch.randn(8, 64)

    def step() -> None:
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        optimizer.step()

    step()
    step()
    optimizer.zero_grad()
    model(x).float().square().mean().backward()
    state = prepared_state(model)
    copies = [] if state is None or state.copies is None else list(state.copies.copies.values())
    known = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *copies,
             *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]  # fmt: skip
    with _NewTensors(known) as made:
        optimizer.step()
    assert plan.transient == made.peak, (plan.transient, made.peak)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "chunks"])
@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
@pytest.mark.parametrize("make", ["adamw", "adam-l2", "sgd-nesterov-wd"])
def test_the_bf16_states_temporaries_are_what_its_step_makes(make: str, level: str, kernel: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """optimizer_state="bf16": Adam(W) and SGD on the CPU by the list kernels (in place: their scalars and table
    alone), else (no toolchain, another device) a chunk's fp32 copies at a time (the 512x1024 weight in two chunks,
    the others in one), measured tensor by tensor (no biases: bf16-sr steps those with its compiled kernel)."""
    from mixprec._src.optim import cpu_adam

    if not kernel:
        monkeypatch.setattr(cpu_adam, "bf16_builds", lambda *_: False)
        monkeypatch.setattr(cpu_adam, "bf16_expected", lambda: False)
    _assert_the_state_steps_temporaries_are_planned(make, level, "bf16")


def _assert_the_state_steps_temporaries_are_planned(make: str, level: str, state_precision: str) -> None:
    """A step of a three-linear model with ``state_precision`` state after two: the most bytes it makes and frees,
    measured tensor by tensor, are the plan's transient bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512, bias=False), nn.Linear(512, 1024, bias=False),
                          nn.Linear(1024, 8, bias=False))  # fmt: skip
    optimizer = OPTIMIZERS[make](model.parameters())
    config = mixprec.PrepareConfig(level=level, optimizer_state=state_precision)
    plan = mixprec.memory_plan(model, optimizer, config)
    mixprec.prepare(model, optimizer, config)
    x = torch.randn(4, 64)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        if _ < 2:
            optimizer.step()
    state = prepared_state(model)
    copies = [] if state is None or state.copies is None else list(state.copies.copies.values())
    tensors = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]  # O2: the masters
    known = [*tensors, *(p.grad for p in tensors if p.grad is not None), *copies,
             *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]  # fmt: skip
    with _NewTensors(known) as made:
        optimizer.step()
    assert plan.transient == made.peak, (plan.transient, made.peak)


def test_torchs_default_on_a_gpu_is_planned_as_its_foreach_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec._src.observe import param_bytes as planning

    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 128))
    plans = {}
    for devices in ([], ["cpu"]):  # as if this CPU were a GPU: torch's default foreach path
        monkeypatch.setattr(planning, "_foreach_devices", lambda devices=devices: devices)
        plans[bool(devices)] = mixprec.memory_plan(model, torch.optim.AdamW(model.parameters()), "fp32").transient
    explicit = mixprec.memory_plan(model, torch.optim.AdamW(model.parameters(), foreach=True), "fp32").transient
    assert plans[True] == explicit == sum(p.numel() * 4 for p in model.parameters())
    # for-loop: two temporaries of the largest parameter, and the denominator of the one before it (a bias)
    assert plans[False] == 2 * 128 * 256 * 4 + 256 * 4
    lr = torch.tensor(1e-3)  # a tensor learning rate without capturable: torch takes the for-loop
    assert mixprec.memory_plan(model, torch.optim.AdamW(model.parameters(), lr=lr), "fp32").transient == plans[False]


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


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
@pytest.mark.parametrize("make", ["adamw", "sgd-nesterov-wd"])
def test_a_quantized_states_list_step_makes_what_the_plan_says(make: str, level: str) -> None:
    """optimizer_state="8bit" on the CPU: Adam(W)'s and SGD's large weights in one call of the list kernels (in
    place: their scalars and table alone), measured tensor by tensor."""
    _assert_the_state_steps_temporaries_are_planned(make, level, "8bit")


@pytest.mark.parametrize("bucket", [3000, 1 << 20])
@pytest.mark.parametrize("clip", [None, 1e3])
def test_the_gradients_the_step_in_backward_holds_are_planned(
    bucket: int, clip: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepping in backward on one process without clipping, gradients wait in a bucket: the most gradient bytes
    alive after any gradient's hooks is at most the plan's ``gradients_in_flight``, and is it where the bucket
    holds them all (or, clipping, where the small ones wait for the step beside the largest)."""
    from mixprec._src.step import step_in_backward

    monkeypatch.setattr(step_in_backward, "BUCKET", bucket)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(),
                          nn.Linear(96, 8))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters())
    config = mixprec.PrepareConfig(level="bf16-sr", step_in_backward=True, clip_grad_norm=clip)
    plan = mixprec.memory_plan(model, optimizer, config)
    mixprec.prepare(model, optimizer, config)
    params = list(model.parameters())
    alive: list[int] = []
    for p in params:  # after prepare's hook: what waits once p was held or stepped
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad.nbytes for q in params
                                                                        if q.grad is not None)))  # fmt: skip
    model(torch.randn(4, 32)).square().sum().backward()
    optimizer.step()
    assert sum(p.numel() >= step_in_backward.SMALL for p in params) == 2
    assert len(alive) == len(params) and max(alive) <= plan.gradients_in_flight
    everything = sum(p.numel() * p.element_size() for p in params)  # the kept norm's fp32, the rest bf16
    if clip is None and bucket > everything:
        assert plan.gradients_in_flight == max(alive) == everything
    if clip is not None:  # the small ones wait for the step, the largest is made beside them
        small = sum(p.numel() * p.element_size() for p in params if p.numel() < step_in_backward.SMALL)
        largest = max(p.numel() * p.element_size() for p in params)
        assert plan.gradients_in_flight == small + largest and max(alive) == small


def test_a_meta_model_is_planned_as_on_the_cpu_with_the_step_in_backward() -> None:
    """The docs' promise, with the step in backward at a bf16 level (a bf16 gradient's norm read where it lies):
    the same bytes from a model built on the meta device as from the same model on the CPU."""
    plans = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1536), nn.GELU(), nn.Linear(1536, 1024)).to(device)
        config = mixprec.PrepareConfig(level="bf16-sr", step_in_backward=True)
        plans[device] = mixprec.memory_plan(model, torch.optim.AdamW(model.parameters()), config)
    assert plans["meta"].gradients_in_flight == plans["cpu"].gradients_in_flight
    assert plans["meta"].gradients == plans["cpu"].gradients
