"""Prepared models under torch.compile as users compile them: whole graphs, no recompiles, eager's numbers.

Every level with its defaults (norm layers kept in fp32), the fp8 recipes, the prepare options, per-layer
precision and tuned recipes: ``torch.compile(model, fullgraph=True)`` makes one graph that later steps
reuse, and ``aot_eager`` (AOTAutograd without a code generator) trains bit for bit as eager does; inductor
within a stated tolerance. A few cases run in ``make test``, the whole matrix (config-built Hugging Face
GPT-2, BERT, Llama and ViT and the bench's workloads) in ``make test-slow``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import mixprec
from helpers import bitwise_equal
from mixprec._src.step import step_in_backward
from mixprec.bench.workloads import WORKLOADS

pytestmark = [
    # Dynamo instantiates every autograd.Function it traces (the fp8 GEMMs', O2's), which torch warns of
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    # module rules' global hooks stay installed after a compiled region with rules (until the next eager
    # region's exit), and torch warns of global hooks when a module compiled later is called
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning"),
]

LEVELS = ("O1", "O2", "bf16-sr", "bf16-pure")
STEPS = 5
# inductor fuses and reorders fp32 arithmetic (and, where it fuses casts, rounds once instead of twice):
# losses within this relative distance of eager's over five steps, and never a different finiteness.
INDUCTOR_RTOL = 2e-2
# with fp8 linears: one fp8 rounding flipped by a reordered sum moves a value by up to 1/8 (e4m3)
INDUCTOR_FP8_RTOL = 5e-2


@pytest.fixture(autouse=True)
def _reset_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----- models and their inputs ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, torch.Tensor]]  # step -> keyword inputs (and "target", the loss's)
    loss: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 16))  # fmt: skip


def _net_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {"input": torch.randn(16, 32, generator=g)}


def _square(out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return out.float().square().mean()


NET = Case(_net, _net_batch, _square)


def _workload(name: str) -> Case:
    def build() -> nn.Module:
        return WORKLOADS[name].build("tiny", torch.device("cpu")).model

    task = WORKLOADS[name].build("tiny", torch.device("cpu"))

    def batch(step: int) -> dict[str, torch.Tensor]:
        x, y = task.batch(step)
        return {"input": x, "target": y}

    def loss(out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return task.loss_fn(out, batch["target"])

    return Case(build, batch, loss)


def _hf_cases() -> dict[str, Case]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    vocab, ids = 64, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

    def gpt2() -> nn.Module:
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=2, **ids,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        # transformers logs a warning from GPT-2's loss on every compile (its loss_type is unset), which
        # Dynamo cannot trace: the unprepared model breaks there too
        model.loss_type = "ForCausalLM"
        return model

    def llama() -> nn.Module:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          **ids)  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    def bert() -> nn.Module:
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=16, pad_token_id=0,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        return transformers.BertForMaskedLM(config)

    def vit() -> nn.Module:
        # problem_type given: transformers sets it on the first call otherwise, a change any compiled
        # model (prepared or not) recompiles for
        config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_labels=5,
                                        problem_type="single_label_classification", hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)  # fmt: skip
        return transformers.ViTForImageClassification(config)

    def tokens(step: int) -> dict[str, torch.Tensor]:
        t = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(100 + step))
        return {"input_ids": t, "labels": t}

    def image(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        return {
            "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (2,), generator=g),
        }

    def hf_loss(out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return out.loss  # type: ignore[no-any-return]

    return {"gpt2": Case(gpt2, tokens, hf_loss), "llama": Case(llama, tokens, hf_loss),
            "bert": Case(bert, tokens, hf_loss), "vit": Case(vit, image, hf_loss)}  # fmt: skip


def _case(name: str) -> Case:
    if name == "net":
        return NET
    if name in WORKLOADS:
        return _workload(name)
    return _hf_cases()[name]


# ----- training a prepared model, eager or compiled --------------------------------------------


def _call(model: Any, batch: dict[str, torch.Tensor]) -> Any:
    """The model on a batch: ``"input"`` positionally (the bench's models), the rest by keyword; no ``"target"``."""
    kwargs = {k: v for k, v in batch.items() if k not in ("input", "target")}
    return model(batch["input"], **kwargs) if "input" in batch else model(**kwargs)


@dataclasses.dataclass
class Run:
    losses: torch.Tensor
    params: list[torch.Tensor]
    frames: list[int]  # graphs compiled so far, after each step


def _prepared(case: Case, level: str, **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = case.build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mixprec.prepare(model, opt, level, **options)


def _train(case: Case, level: str, backend: str | None, steps: int = STEPS, **options: Any) -> Run:
    """``steps`` AdamW steps of the prepared model, eager (``backend=None``) or compiled with fullgraph=True."""
    torch._dynamo.reset()
    model, opt = _prepared(case, level, **options)
    counter = None if backend is None or backend == "inductor" else CompileCounterWithBackend(backend)
    run = model if backend is None else torch.compile(model, fullgraph=True, backend=counter or backend)
    losses, frames = [], []
    for step in range(steps):
        batch = case.batch(step)
        loss = case.loss(_call(run, batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        frames.append(counter.frame_count if counter is not None else 0)
    return Run(torch.stack(losses), [p.detach().clone() for p in model.parameters()], frames)


def _assert_compiles_like_eager(case: Case, level: str, **options: Any) -> None:
    eager = _train(case, level, None, **options)
    compiled = _train(case, level, "aot_eager", **options)
    assert compiled.frames == [1] * STEPS, compiled.frames  # one graph, reused by every later step
    assert bitwise_equal(compiled.losses, eager.losses), (compiled.losses, eager.losses)
    assert bitwise_equal(compiled.params, eager.params)


# ----- make test: every level on a model with a norm layer kept (prepare's default) -------------


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_with_its_defaults_compiles_whole_and_trains_as_eager(level: str) -> None:
    _assert_compiles_like_eager(NET, level)


@pytest.mark.parametrize("fp8", ["tensorwise", "delayed", "mxfp8", "nvfp4"])
def test_fp8_recipes_compile_whole_and_train_as_eager(fp8: str) -> None:
    # nvfp4's stochastic rounding included: its noise is a function of the layer's counter, not a generator's draw
    _assert_compiles_like_eager(NET, "O2", fp8=fp8)


@pytest.mark.parametrize(
    "options",
    [
        {"keep_names": ("3",)},
        {"keep_filter": lambda module, name: name == "5"},
        {"keep_types": ()},
        {"output_dtype": None},
        {"output_dtype": torch.bfloat16},
        {"policy": "compute=bf16,fp32=relu"},
        {"optimizer_state": "bf16"},
    ],
    ids=["keep_names", "keep_filter", "no_kept", "output_as_computed", "output_bf16", "edited_policy", "bf16_state"],
)
def test_prepare_options_compile_whole_and_train_as_eager(options: dict[str, Any]) -> None:
    _assert_compiles_like_eager(NET, "O2", **options)


@pytest.mark.parametrize("level", ["O2", "bf16-sr"])
def test_stepping_in_backward_with_quantized_state_compiles_whole_and_trains_as_eager(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the parameters are stepped from hooks that run after the compiled backward, eagerly
    _assert_compiles_like_eager(NET, level, optimizer_state="8bit", step_in_backward=True, clip_grad_norm=0.5)
    monkeypatch.setattr(step_in_backward, "BUCKET", 1)  # each gradient fills the bucket: stepped as it comes
    model, opt = _prepared(NET, level, optimizer_state="8bit", step_in_backward=True)
    batch = NET.batch(0)
    NET.loss(_call(torch.compile(model, fullgraph=True, backend="aot_eager"), batch), batch).backward()
    large = [p for p in model.parameters() if p.numel() >= step_in_backward.SMALL]
    assert large and all(p.grad is None and opt.state[p] for p in large)  # stepped in the backward
    assert any(k.endswith("_codes") for p in model.parameters() for k in opt.state[p])
    opt.step()
    assert all(p.grad is None and opt.state[p] for p in model.parameters())


# ----- make test-slow: the matrix --------------------------------------------------------------

MODELS = ("gpt2", "bert", "llama", "vit", *WORKLOADS)
# every level with its defaults; both fp8 recipes at O2 (fp32 masters), delayed at bf16-sr (bf16 weights)
RECIPES = [(level, None) for level in LEVELS] + [
    ("O2", "tensorwise"),
    ("O2", "delayed"),
    ("bf16-sr", "delayed"),
    ("O2", "mxfp8"),
    ("bf16-sr", "nvfp4"),
]


@pytest.mark.slow
# the cnn's GEMMs are 3x3 convolutions (and a misaligned 1x1 head), which fp8 does not take: prepare says so
@pytest.mark.filterwarnings("ignore:fp8 was asked for but no layer was converted:UserWarning")
@pytest.mark.parametrize(("level", "fp8"), RECIPES)
@pytest.mark.parametrize("model", MODELS)
def test_matrix_compiles_whole_and_trains_as_eager(model: str, level: str, fp8: str | None) -> None:
    _assert_compiles_like_eager(_case(model), level, **({} if fp8 is None else {"fp8": fp8}))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:fp8 was asked for but no layer was converted:UserWarning")
@pytest.mark.filterwarnings("ignore:bf16 and fp16 are mixed in the scheduler node:UserWarning")  # inductor's note
@pytest.mark.parametrize(
    ("model", "fp8"),
    [(model, None) for model in MODELS]
    + [("llama", "delayed"), ("gpt2", "tensorwise"), ("gpt2", "delayed"), ("bert", "tensorwise")]
    + [("llama", "mxfp8"), ("gpt2", "nvfp4")],
)
def test_matrix_under_inductor_trains_within_tolerance(model: str, fp8: str | None) -> None:
    options = {} if fp8 is None else {"fp8": fp8}
    eager = _train(_case(model), "O2", None, **options)
    compiled = _train(_case(model), "O2", "inductor", **options)
    rtol = INDUCTOR_RTOL if fp8 is None else INDUCTOR_FP8_RTOL
    torch.testing.assert_close(compiled.losses, eager.losses, rtol=rtol, atol=0)


def test_inductor_trains_within_tolerance_of_eager() -> None:
    eager = _train(NET, "O2", None)
    compiled = _train(NET, "O2", "inductor")
    torch.testing.assert_close(compiled.losses, eager.losses, rtol=INDUCTOR_RTOL, atol=0)


def _recipe_run(recipe: mixprec.Recipe, backend: Any = None) -> torch.Tensor:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _net()
    mixprec.set_layer_precision(model, "0", "fp32")  # what a per-layer plan or the guard sets
    mixprec.set_layer_precision(model, "3", "fp8-tensorwise")
    run = recipe.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    call = run.model if backend is None else torch.compile(run.model, fullgraph=True, backend=backend)
    losses = []
    for step in range(STEPS):
        with run.autocast():
            loss = _square(call(**_net_batch(step)), {})
        run.backward(loss)
        run.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_per_layer_precision_and_a_tuned_recipe_compile_whole() -> None:
    recipe = mixprec.Recipe(level="O2", dtype=torch.bfloat16, keep_fp32=("5",), fp8="tensorwise")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _recipe_run(recipe, counter)
    assert counter.frame_count == 1
    assert bitwise_equal(compiled, _recipe_run(recipe))


def test_a_compiled_o1_recipe_with_moved_ops_opens_its_region_inside_the_graph() -> None:
    # Compiled inside an eager region with an edited policy, a graph is refused; a recipe that compiles
    # puts its region inside the model's forward instead, and trains as the eager recipe does.
    recipe = mixprec.Recipe(level="O1", dtype=torch.bfloat16, fp32_ops=("relu",), keep_fp32=("5",), compile=True)
    compiled = _recipe_run(recipe)
    eager = _recipe_run(dataclasses.replace(recipe, compile=False))
    torch.testing.assert_close(compiled, eager, rtol=INDUCTOR_RTOL, atol=0)
    with pytest.raises(Exception, match="Open the region inside the compiled function"):
        _recipe_run(dataclasses.replace(recipe, compile=False), "aot_eager")


# ----- precision holds: a backward in the precision its forward chose -----------------------------


def _overflow_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))


def _kept_by_prepare(model: nn.Module) -> tuple[nn.Module, Callable[[], Any]]:
    model, _ = mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", torch.float16,
                               keep_names="0", keep_types=())  # fmt: skip
    return model, functools.partial(torch.autocast, "cpu", dtype=torch.float16)


def _kept_by_rule(model: nn.Module) -> tuple[nn.Module, Callable[[], Any]]:
    policy = mixprec.get_policy("cpu").keep_modules(names="0")
    return model, functools.partial(mixprec.autocast, "cpu", dtype=torch.float16, policy=policy)


def _kept_by_layer_precision(model: nn.Module) -> tuple[nn.Module, Callable[[], Any]]:
    mixprec.set_layer_precision(model, "0", "fp32")
    return model, functools.partial(torch.autocast, "cpu", dtype=torch.float16)


def _first_layer_grads(keep: Callable[[nn.Module], tuple[nn.Module, Callable[[], Any]]]) -> list[torch.Tensor]:
    """Layer 0's weight gradient, eager then compiled, called inside an fp16 region; it computes in fp32."""
    model, region = keep(_overflow_net())
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 3e4  # fp16 gradients overflow
    grads = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        with region():
            out = run(x)
        out.float().square().mean().backward()
        grads.append(model[0].weight.grad.clone())  # type: ignore[union-attr]
    return grads


@pytest.mark.parametrize("keep", [_kept_by_prepare, _kept_by_rule, _kept_by_layer_precision],
                         ids=["prepare_keeps", "module_rule", "layer_precision"])  # fmt: skip
def test_a_module_kept_in_fp32_gets_fp32_gradients_when_compiled(keep: Any) -> None:
    default = torch._functorch.config.backward_pass_autocast
    eager, compiled = _first_layer_grads(keep)
    assert torch.isfinite(eager).all()
    assert bitwise_equal(compiled, eager)
    assert torch._functorch.config.backward_pass_autocast == default  # torch's setting as it was


def test_an_export_leaves_torchs_backward_autocast_as_it_was() -> None:
    # torch.export traces mixprec's regions too, but ends with no Dynamo end-of-compile callback to restore
    # the setting (and an exported graph has no backward): nothing is changed there
    model, _ = _prepared(NET, "O1")
    torch.export.export(model, (_net_batch(0)["input"],))
    assert torch._functorch.config.backward_pass_autocast == "same_as_forward"


def test_a_backward_autocast_the_user_set_is_left_alone() -> None:
    # torch's setting, chosen by the user (autocast, in bf16 on a CPU, during the backward): gradients follow it
    in_bf16 = [{"device_type": "cpu"}]
    with torch._functorch.config.patch(backward_pass_autocast=in_bf16):
        eager, compiled = _first_layer_grads(_kept_by_layer_precision)
        assert torch._functorch.config.backward_pass_autocast == in_bf16
    assert not bitwise_equal(compiled, eager)


# ----- no recompiles as training goes on -----------------------------------------------------------


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 16))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process
@pytest.mark.parametrize("level", ["O2", "bf16-sr"])
def test_no_recompiles_across_steps_accumulation_loads_and_eval(level: str, tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    model = _dropout_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.prepare(model, opt, level, fp8="delayed")
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(fullgraph=True, backend=counter)  # nn.Module.compile: the module compiles in place
    saved = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path)
    g = torch.Generator().manual_seed(0)
    frames = []
    for step in range(6):
        for _ in range(2):  # gradient accumulation: two forwards and backwards a step
            model(torch.randn(8, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:  # an evaluation pass: a graph of its own (no grad, dropout off), compiled once
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 32, generator=g))
            model.train()
        if step == 3:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        if step == 4:
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=tmp_path)
            model.load_state_dict(state["model"])
        frames.append(counter.frame_count)
    assert frames == [1, 1, 2, 2, 2, 2], frames


def _compiled_step_losses(
    level: str, optimizer: Callable[..., torch.optim.Optimizer], compiled: bool, scheduler: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """Losses of a training step compiled whole (forward, backward, optimizer), and graphs made after each."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _net()
    model, opt = mixprec.prepare(model, optimizer(model.parameters()), level, fp8="delayed")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = torch.compile(step, backend="aot_eager") if compiled else step
    losses, graphs = [], []
    for i in range(STEPS):
        losses.append(run(_net_batch(i)["input"]))
        if sched is not None:
            sched.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return torch.stack(losses), graphs


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


# Dynamo reads .grad of tensors it does not know to be leaves while it traces an optimizer step
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("level", [pytest.param(level, marks=() if level in ("O2", "bf16-sr") else pytest.mark.slow)
                                   for level in LEVELS])  # fmt: skip
def test_a_training_step_compiled_whole_trains_as_eager(level: str) -> None:
    # SGD's compiled update is eager's to the bit (torch compiles AdamW's in another order), so any
    # update a compiled step skipped or repeated (rounding, O2's copies, fp8 histories) shows.
    compiled, graphs = _compiled_step_losses(level, _sgd, True)
    # step 2 may add graphs (the optimizer's state exists from then on, as for any compiled step), no later one
    assert graphs[0] > 0 and graphs[2:] == graphs[1:2] * (STEPS - 2), graphs
    assert bitwise_equal(compiled, _compiled_step_losses(level, _sgd, False)[0])


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_bf16_sr_adamw_in_a_compiled_step_rounds_every_step_with_a_scheduler() -> None:
    # Dynamo runs an optimizer's _init_group once, at trace time: bf16-sr's fused update lives there, so
    # its step runs eagerly inside a compiled training step (else every later step skipped the update).
    compiled, _ = _compiled_step_losses("bf16-sr", _adamw, True, scheduler=True)
    assert bitwise_equal(compiled, _compiled_step_losses("bf16-sr", _adamw, False, scheduler=True)[0])


# ----- the guard and the monitor on a compiled model ------------------------------------------------


def test_guard_and_monitor_on_an_fp8_model_compile_whole_and_read_as_eager() -> None:
    # The guard's probes, the fp8 layers' cast statistics and the monitor's forward hook are all traced
    # into the graph (fullgraph=True raises at a break): what they read equals an eager run's.
    def run(compiled: bool) -> tuple[list[Any], list[Any], int]:
        torch._dynamo.reset()
        model, opt = _prepared(NET, "O2", fp8="tensorwise")
        scaler = mixprec.GradScaler("cpu")
        guard = mixprec.Guard(model, scaler)
        monitor = mixprec.Monitor(model, scaler, fp8_stats=True)
        counter = CompileCounterWithBackend("aot_eager")
        call = torch.compile(model, fullgraph=True, backend=counter) if compiled else model
        readings, fp8 = [], []
        for step in range(3):
            loss = _square(call(**_net_batch(step)), {})
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            fp8.append(monitor.fp8_stats())
            readings.append(guard._read())
        monitor.close()
        guard.close()
        return readings, fp8, counter.frame_count

    eager, compiled = run(False), run(True)
    assert compiled[2] == 1
    assert eager[1][0]["3"]["grad_output"]["amax"] > 0  # the backward's cast was recorded
    assert compiled[:2] == eager[:2]


def _fp16_scaled_run(compiled: bool) -> torch.Tensor:
    torch._dynamo.reset()
    model, opt = _prepared(NET, "O2", dtype=torch.float16)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**16)
    call = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    losses = []
    for step in range(STEPS):
        loss = _square(call(**_net_batch(step)), {}) * 1e3  # large enough that the first scales overflow
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack([*losses, torch.tensor(scaler.get_scale())])


def test_fp16_with_a_grad_scaler_compiles_whole_and_trains_as_eager() -> None:
    assert bitwise_equal(_fp16_scaled_run(True), _fp16_scaled_run(False))
