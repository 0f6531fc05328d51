"""PrepareConfig: one value for what prepare does; the same as the keyword options."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import ROOT, bitwise_equal, regression_data, regression_model, weights_seen
from mixprec._src.prepare.levels import prepared_state


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure"])
def test_a_config_prepares_as_the_same_options_do(level: str) -> None:
    runs = []
    for as_config in (False, True):
        torch.manual_seed(7)
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if as_config:
            config = mixprec.PrepareConfig(level=level, keep_names=("2",), output_dtype=None)  # type: ignore[arg-type]
            model, opt = mixprec.prepare(model, opt, config)
        else:
            model, opt = mixprec.prepare(model, opt, level, keep_names="2", output_dtype=None)
        for x, y in regression_data(3):
            opt.zero_grad()
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert bitwise_equal(runs[0], runs[1])


def test_keep_filter_keeps_the_modules_it_accepts_in_fp32() -> None:
    model = regression_model()
    opt = torch.optim.AdamW(model.parameters())
    config = mixprec.PrepareConfig(level="O2", keep_filter=lambda module, name: name == "5")  # type: ignore[arg-type]
    model, opt = mixprec.prepare(model, opt, config)
    seen = weights_seen(model)
    assert model(regression_data(1)[0][0]).dtype is torch.float32
    assert {name: dtype for name, (dtype, _) in seen.items()} == {
        "0": torch.bfloat16, "1": torch.float32, "3": torch.bfloat16, "5": torch.float32  # the norm, and the head
    }  # fmt: skip


def test_the_configs_policy_reaches_the_prepared_forward() -> None:
    # every Linear moved to fp32: at O1 the prepared model computes what the fp32 model computes
    policy = mixprec.get_policy("cpu").add("fp32", "linear", "addmm", "mm", "matmul")
    x = regression_data(1)[0][0]
    want = regression_model()(x)
    for chosen, equal in ((policy, True), (None, False)):
        model = regression_model()
        config = mixprec.PrepareConfig(level="O1", policy=chosen)  # type: ignore[arg-type]
        model, _ = mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        assert bitwise_equal(model(x), want) is equal


def test_a_config_checks_itself_and_is_not_mixed_with_options() -> None:
    with pytest.raises(ValueError, match="level 'bf16-sr' keeps weights in bf16"):
        mixprec.PrepareConfig(level="bf16-sr", dtype="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown level 'O3'"):
        mixprec.PrepareConfig(level="O3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_filter must be a callable"):
        mixprec.PrepareConfig(keep_filter="head")  # type: ignore[arg-type]
    for word in ("no", "false", 0):  # a string that reads as true is not taken as a switch
        with pytest.raises(TypeError, match="step_in_backward takes True or False"):
            mixprec.PrepareConfig(step_in_backward=word)  # type: ignore[arg-type]
    model = regression_model()
    with pytest.raises(TypeError, match="a PrepareConfig or options, not both"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), mixprec.PrepareConfig(), keep_names="2")
    config = mixprec.PrepareConfig(level="O2", keep_types=nn.LayerNorm, keep_names="5")  # type: ignore[arg-type]
    assert config.keep_types == (nn.LayerNorm,) and config.keep_names == ("5",)
    assert str(config) == "O2 bf16, keep=LayerNorm+'5', output=fp32"
    assert str(mixprec.PrepareConfig()) == "O2 bf16, keep=norm, output=fp32"


def test_options_are_parsed_once_by_keyword_and_refused_by_name() -> None:
    model = regression_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(TypeError, match="unknown option\\(s\\) keep_name; prepare takes dtype, keep_types, keep_names"):
        mixprec.prepare(model, optimizer, "O2", keep_name="head")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="optimizer_state takes a name such as 'bf16'"):
        mixprec.prepare(model, optimizer, "O2", optimizer_state=8)  # type: ignore[typeddict-item]
    with pytest.raises(TypeError, match="keep_names takes qualified-name globs"):
        mixprec.prepare(model, optimizer, "O2", keep_names=[nn.Linear])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="step_in_backward takes True or False"):
        mixprec.prepare(model, optimizer, "O2", step_in_backward="no")  # type: ignore[typeddict-item]
    assert prepared_state(model) is None  # every refusal before anything was installed
    # the positional dtype and the keyword options build the one config a PrepareConfig would be
    mixprec.prepare(model, optimizer, "O1", torch.float16, keep_names="2", clip_grad_norm=1)
    config = prepared_state(model).config  # type: ignore[union-attr]
    assert config == mixprec.PrepareConfig(level="O1", dtype=torch.float16, keep_names=("2",), clip_grad_norm=1.0)  # type: ignore[arg-type]


def test_choices_are_enums_that_read_and_print_as_their_names() -> None:
    config = mixprec.PrepareConfig(level="bf16-sr", optimizer_state="8bit")  # type: ignore[arg-type]
    assert config.level is mixprec.Level.BF16_SR and config.optimizer_state is mixprec.StatePrecision.INT8
    assert f"{config.level} {config.optimizer_state}" == "bf16-sr 8bit" and config.optimizer_state == "8bit"
    assert str(config) == "bf16-sr bf16, keep=norm, output=fp32, state=8bit"
    sp = mixprec.StatePrecision
    assert [(p.own, p.quantized, p.bits, p.block) for p in sp] == [
        (False, False, 32, 0), (True, False, 16, 0), (True, True, 8, 256), (True, True, 4, 128), (True, True, 8, 256)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown optimizer_state '2bit'; valid optimizer states: fp32, bf16, 8bit"):
        sp.from_name("2bit")
    lp = mixprec.LayerPrecision
    assert lp.from_name(torch.bfloat16) is lp.from_name("bfloat16") is lp.BF16
    assert [p.rung for p in lp] == [0, 1, 2, 2, 2, 2, 3, 3, 4]
    assert [p.block for p in lp] == [True, True] + [False] * 7 and lp.NVFP4.fp8_recipe is mixprec.Fp8Recipe.NVFP4
    assert lp.FP8_ROWWISE.fp8_recipe is mixprec.Fp8Recipe.ROWWISE and lp.FP16.dtype is torch.float16
    with pytest.raises(ValueError, match="unknown layer precision 'fp4'; valid: nvfp4, mxfp8, fp8-delayed"):
        lp.from_name("fp4")
    recipe = mixprec.Recipe(level="O2", optimizer_state="bf16")  # type: ignore[arg-type]
    assert recipe.level is mixprec.Level.O2 and recipe.optimizer_state is sp.BF16
    assert mixprec.Recipe.from_json(recipe.to_json()) == recipe


def test_a_config_pickled_with_choices_as_strings_loads_them_as_enums() -> None:
    config = mixprec.PrepareConfig(level="O2", optimizer_state="bf16")  # type: ignore[arg-type]
    state = {**config.__dict__, "level": "O2", "optimizer_state": "bf16"}  # as an older version pickled it
    loaded = mixprec.PrepareConfig.__new__(mixprec.PrepareConfig)
    loaded.__setstate__(state)
    assert loaded.optimizer_state is mixprec.StatePrecision.BF16 and loaded.level is mixprec.Level.O2
    assert loaded == config and pickle.loads(pickle.dumps(config)) == config


def test_no_choice_is_compared_with_a_bare_precision_name_outside_its_parser() -> None:
    """Choices are enums: a comparison with ``"fp32"`` (or another state or layer precision's name) is a
    choice typed twice; the parsers, which turn the names into members, are the exception."""
    compared = re.compile(r'[!=]=\s*"(fp32|bf16|8bit|4bit|fp8)"|"(fp32|bf16|8bit|4bit|fp8)"\s*[!=]=')
    parsers = {"observe/memory_plan.py": 1}  # memory_plan's recipe argument: "fp32" means no recipe
    found = {}
    for path in sorted((ROOT / "src/mixprec/_src").rglob("*.py")):
        hits = [line for line in path.read_text().splitlines() if compared.search(line.split("#")[0])]
        if hits:
            found[path.relative_to(ROOT / "src/mixprec/_src").as_posix()] = len(hits)
    assert found == parsers
