"""fp8 through prepare: which layers, every level, GradScaler, checkpoints that resume and move between recipes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

import mixprec
from helpers import bitwise_equal, regression_data
from mixprec._src.fp8.linear import Fp8Scaling

# DCP says it saves and loads in one process: what these tests mean to do.
ONE_PROCESS_DCP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
        self.kept = nn.Linear(40, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.inp(x)))
        return self.head(F.gelu(self.kept(self.odd(h + self.mlp(h)))))


def prepared(recipe: str | mixprec.Fp8Config | None, level: str = "O2", **options: Any) -> tuple[Net, Any]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, level, fp8=recipe, keep_names="kept", **options)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, scaler: Any = None) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(regression_data(steps.stop)):
        if i not in steps:
            continue
        loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def test_prepare_lists_the_layers_converted_and_those_left_out_with_reasons() -> None:
    model, _ = prepared("tensorwise")
    layers = mixprec.fp8_layers(model)
    assert layers is not None and layers.converted == ["inp", "mlp.0", "mlp.2"]
    reasons = dict(layers.skipped)
    assert reasons.keys() == {"odd", "kept", "head"}
    assert "out_features 40 not a multiple of 16" in reasons["odd"]
    assert "kept in fp32" in reasons["kept"] and "output head" in reasons["head"]
    assert "3 layer(s) in fp8, 3 left out" in str(layers) and "odd: out_features 40" in str(layers)
    assert isinstance(model.inp.fp8, Fp8Scaling) and not hasattr(model.head, "fp8")


def test_names_filter_and_head_choose_the_layers() -> None:
    config = mixprec.Fp8Config("rowwise", names="mlp.*", filter=lambda m, name: m.out_features > 64,
                               convert_head=True)  # fmt: skip
    model, _ = prepared(config)
    assert mixprec.fp8_layers(model).converted == ["mlp.0"]  # type: ignore[union-attr]
    assert "not selected" in dict(mixprec.fp8_layers(model).skipped)["inp"]  # type: ignore[union-attr]
    assert str(config) == "fp8 rowwise names=mlp.* filter=<lambda> +head"
    assert "fp8 delayed(history=1024, margin=0, max)" in str(mixprec.PrepareConfig(fp8="delayed"))


def test_export_fp32_reverts_the_conversion() -> None:
    model, opt = prepared("delayed")
    mixprec.export_fp32(model, opt)
    assert mixprec.fp8_layers(model) is None and "forward" not in model.inp.__dict__
    assert model.state_dict().keys() == Net().state_dict().keys()


def test_bad_fp8_options_say_what_is_valid() -> None:
    with pytest.raises(ValueError, match="valid fp8 recipes: tensorwise, rowwise"):
        mixprec.Fp8Config("blockwise")
    with pytest.raises(ValueError, match="history_len"):
        mixprec.Fp8Config("delayed", history_len=0)
    with pytest.raises(TypeError, match="recipe name, an Fp8Config"):
        mixprec.PrepareConfig(fp8=3)  # type: ignore[arg-type]


# Every recipe at O2 and every level with delayed scaling in the default suite; the whole grid in the slow one.
LEVEL_CASES = [pytest.param(recipe, level, marks=() if level == "O2" or recipe == "delayed" else pytest.mark.slow,
                            id=f"{recipe}-{level}")
               for recipe in RECIPES for level in ("O1", "O2", "bf16-sr")]  # fmt: skip


@pytest.mark.parametrize(("recipe", "level"), LEVEL_CASES)
def test_every_level_trains_with_every_recipe(recipe: str, level: str) -> None:
    model, opt = prepared(recipe, level)
    seen: dict[str, torch.dtype] = {}
    model.mlp[0].register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    losses = train(model, opt, range(30))
    assert seen["dtype"] == torch.bfloat16  # autocast's dtype, from the fp8 GEMM's output
    assert losses[-1] < 0.5 * losses[0], losses
    fp32_params = level in ("O1", "O2")
    assert (model.mlp[0].weight.dtype == torch.float32) == fp32_params
    if recipe == "delayed":
        assert model.mlp[0].fp8.history.dtype == torch.float32 and model.mlp[0].fp8.history[:, 29].all()


def test_fp16_grad_scaler_skips_overflow_and_keeps_the_history_finite() -> None:
    model, opt = prepared("delayed", "O1", dtype=torch.float16)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**20)  # the first steps overflow fp16 gradients
    train(model, opt, range(16), scaler)
    assert scaler.stats().skipped_iterations >= 1
    history = model.mlp[0].fp8.history
    assert torch.isfinite(history).all() and history[2, 0] > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_from_state_dict_is_bitwise(recipe: str, tmp_path: Path) -> None:
    model, opt = prepared(recipe)
    train(model, opt, range(4))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    train(model, opt, range(4, 8))
    again, opt2 = prepared(recipe)
    saved = torch.load(tmp_path / "ckpt.pt")
    again.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(again, opt2, range(4, 8))
    assert bitwise_equal(model.state_dict(), again.state_dict())
    if recipe == "delayed":
        assert {"inp.fp8.history", "inp.fp8.pending"} <= saved["model"].keys()


@ONE_PROCESS_DCP
def test_resume_through_distributed_checkpoint_is_bitwise(tmp_path: Path) -> None:
    model, opt = prepared("delayed")
    train(model, opt, range(3))
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path)
    again, _ = prepared("delayed")
    state = {"model": again.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    again.load_state_dict(state["model"])
    assert bitwise_equal(model.state_dict(), again.state_dict()) and model.inp.fp8.history.any()


@ONE_PROCESS_DCP
def test_checkpoints_move_between_fp8_and_bf16_recipes(tmp_path: Path) -> None:
    fp8_model, fp8_opt = prepared("delayed")
    train(fp8_model, fp8_opt, range(3))
    bf16_model, bf16_opt = prepared(None)
    bf16_model.load_state_dict(fp8_model.state_dict())  # strict: the amax histories are ignored
    assert all(torch.equal(a, b) for a, b in zip(bf16_model.parameters(), fp8_model.parameters(), strict=True))
    assert fp8_model.inp.weight.dtype == torch.float32  # weights are saved at full precision
    train(bf16_model, bf16_opt, range(3, 5))
    back, _ = prepared("delayed")
    back.load_state_dict(bf16_model.state_dict())  # strict: the histories start afresh
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), bf16_model.parameters(), strict=True))
    assert not back.inp.fp8.history.any()
    dynamic, _ = prepared("rowwise")
    dynamic.load_state_dict(fp8_model.state_dict())
    # Through DCP: the checkpoint of the fp8 recipe holds more than a bf16 model asks for.
    dcp.save({"model": fp8_model.state_dict()}, checkpoint_id=tmp_path / "fp8")
    plain = {"model": prepared(None)[0].state_dict()}
    dcp.load(plain, checkpoint_id=tmp_path / "fp8")
    assert torch.equal(plain["model"]["inp.weight"], fp8_model.inp.weight)
    # The other way, DCP asks for the histories a bf16 checkpoint does not hold: a partial load.
    dcp.save({"model": bf16_model.state_dict()}, checkpoint_id=tmp_path / "bf16")
    delayed = {"model": prepared("delayed")[0].state_dict()}
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: model\.inp\.fp8\.history"):
        dcp.load(delayed, checkpoint_id=tmp_path / "bf16")
    dcp.load(delayed, checkpoint_id=tmp_path / "bf16", planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(delayed["model"]["inp.weight"], bf16_model.inp.weight)


def test_strict_loading_still_reports_keys_of_another_model() -> None:
    model, _ = prepared(None)
    state = copy.deepcopy(prepared("delayed")[0].state_dict())
    state["nothere.fp8.history"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"nothere\.fp8\.history"):
        model.load_state_dict(state)


def test_a_recipe_with_fp8_applies_it_and_round_trips() -> None:
    recipe = mixprec.Recipe(dtype="bf16", fp8="rowwise", fp32_ops=("softmax",))
    assert recipe.name == "bf16 O1 +fp32[softmax] fp8[rowwise]" and not recipe.is_torch_default
    assert mixprec.Recipe.from_json(recipe.to_json()) == recipe
    model = Net()
    run = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mixprec.fp8_layers(run.model).converted == ["inp", "mlp.0", "mlp.2"]  # type: ignore[union-attr]
    with run.autocast():  # a no-op: the prepared forward opens the recipe's region
        assert not torch.is_autocast_enabled("cpu")
    assert run.model(torch.randn(4, 16)).dtype == torch.float32
    with pytest.raises(ValueError, match="fp8 linears train beside a low-precision recipe"):
        mixprec.Recipe(dtype="fp32", fp8="tensorwise")


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # Dynamo's own, any Function
def test_a_prepared_fp8_model_compiles_into_one_graph() -> None:
    """O1 with delayed scaling (no module kept in fp32: the keep hooks do not trace in one graph yet)."""
    torch._dynamo.reset()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        models.append(mixprec.prepare(model, opt, "O1", fp8="delayed", keep_types=()))
    (eager, eager_opt), (compiled_model, opt) = models
    train(eager, eager_opt, range(2))
    train(torch.compile(compiled_model, fullgraph=True, backend="aot_eager"), opt, range(2))
    assert bitwise_equal(eager.state_dict(), compiled_model.state_dict()) and eager[0].fp8.history[:, 1].all()


def test_names_match_the_modules_holding_a_linear_as_keep_names_does() -> None:
    model, _ = prepared(mixprec.Fp8Config("tensorwise", names="mlp"))
    assert mixprec.fp8_layers(model).converted == ["mlp.0", "mlp.2"]  # type: ignore[union-attr]


def test_converting_nothing_warns() -> None:
    with pytest.warns(UserWarning, match=r"no layer was converted \(6 left out\)"):
        prepared(mixprec.Fp8Config("tensorwise", names="block.*"))  # a typo: the model has no "block"


def test_options_that_would_do_nothing_are_refused() -> None:
    with pytest.raises(ValueError, match="use recipe 'delayed' with them"):
        mixprec.Fp8Config("tensorwise", margin=2)
    with pytest.raises(TypeError, match="convert_head is True or False"):
        mixprec.Fp8Config(convert_head="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="qualified-name globs"):
        mixprec.Fp8Config(names=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scales weights per row: use tensorwise or delayed"):
        mixprec.Fp8Config("rowwise", all_gather=True)
    with pytest.raises(ValueError, match="no fully_shard units: shard it first"):
        prepared(mixprec.Fp8Config("tensorwise", all_gather=True))
    with pytest.raises(TypeError, match=r"PrepareConfig\(fp8=mixprec\.Fp8Config"):
        mixprec.Recipe(fp8=mixprec.Fp8Config("delayed"))  # type: ignore[arg-type]


def test_a_history_of_another_length_loads_its_newest_entries() -> None:
    short, opt = prepared(mixprec.Fp8Config("delayed", history_len=4))
    train(short, opt, range(6))
    longer, _ = prepared(mixprec.Fp8Config("delayed", history_len=8))
    longer.load_state_dict(short.state_dict())
    assert torch.equal(longer.inp.fp8.history[:, :4], short.inp.fp8.history) and not longer.inp.fp8.history[:, 4:].any()
    shorter, _ = prepared(mixprec.Fp8Config("delayed", history_len=2))
    shorter.load_state_dict(short.state_dict())
    assert torch.equal(shorter.inp.fp8.history, short.inp.fp8.history[:, :2])


def test_an_evaluation_under_no_grad_records_nothing() -> None:
    model, opt = prepared("delayed")
    train(model, opt, range(2))
    before = model.inp.fp8.pending.clone()
    with torch.no_grad():
        model(torch.randn(8, 16) * 100)
    assert torch.equal(model.inp.fp8.pending, before)


def test_a_refused_fp8_prepare_leaves_the_model_as_it_was() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no fully_shard units"):
        mixprec.prepare(model, opt, "O2", fp8=mixprec.Fp8Config(all_gather=True))
    assert not model.norm._forward_pre_hooks and not opt._optimizer_step_pre_hooks
    mixprec.prepare(model, opt, "O2", fp8="tensorwise")  # and it can be prepared right after


def test_checkpoints_move_between_block_scaled_and_other_recipes() -> None:
    nvfp4, nvfp4_opt = prepared("nvfp4")
    train(nvfp4, nvfp4_opt, range(3))
    assert any(k.endswith("fp8.noise") for k in nvfp4.state_dict())
    for other in (None, "mxfp8", "delayed"):  # strict: nvfp4's rounding counters are ignored where none is kept
        model, _ = prepared(other)
        model.load_state_dict(nvfp4.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), nvfp4.parameters(), strict=True))
    back, _ = prepared("nvfp4")
    back.load_state_dict(prepared("mxfp8")[0].state_dict())  # strict: the counters keep their own
    back.load_state_dict(nvfp4.state_dict())  # and take an nvfp4 checkpoint's
    counters = {k: v for k, v in nvfp4.state_dict().items() if k.endswith("fp8.noise")}
    assert all(torch.equal(back.state_dict()[k], v) for k, v in counters.items()) and counters
