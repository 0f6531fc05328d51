"""PyTorch Lightning and Hugging Face Accelerate run mixprec with the numbers of their own AMP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import bitwise_equal

# The frameworks warn about CPU-only runs, worker counts and logging: not ours to fix here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


# --- Lightning ------------------------------------------------------------------------------


def _lightning_run(**trainer_kwargs: Any) -> tuple[list[torch.Tensor], list[float]]:
    pl = pytest.importorskip("lightning.pytorch")

    class Regressor(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = Regressor()
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)  # fmt: skip
    trainer.fit(model, loader)
    masters = trainer.optimizers[0].param_groups[0]["params"]
    return [p.detach().float().clone() for p in masters], model.losses


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_plugin_matches_lightning_amp(precision: str) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.integrations.lightning import MixprecPrecision

    # Lightning's own plugin, named explicitly: Trainer(precision="16-mixed") on a CPU switches to bf16.
    expected = _lightning_run(plugins=[MixedPrecision(precision, "cpu")])
    got = _lightning_run(plugins=[MixprecPrecision(precision)])
    assert bitwise_equal(expected, got)
    assert not bitwise_equal(expected, _lightning_run(precision="32-true"))  # the comparison can fail


def test_lightning_plugin_levels() -> None:
    pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    params, losses = _lightning_run(plugins=[MixprecPrecision("O2")])
    assert all(p.dtype is torch.float32 for p in params)  # the optimizer holds fp32 masters
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="valid: bf16-mixed, 16-mixed, O2"):
        MixprecPrecision("O3")


# --- Accelerate -----------------------------------------------------------------------------


def _accelerate_run(cls: Any, mixed_precision: str) -> tuple[list[torch.Tensor], list[float]]:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = cls(mixed_precision=mixed_precision, cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
    with accelerator.autocast():
        inside = model(x).dtype
    AcceleratorState._reset_state(reset_partial_state=True)
    return [p.detach().clone() for p in model.parameters()], [*losses, str(inside)]  # type: ignore[list-item]


def test_accelerate_matches_accelerate_amp() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from mixprec.integrations.accelerate import MixprecAccelerator

    expected = _accelerate_run(Accelerator, "bf16")
    got = _accelerate_run(MixprecAccelerator, "bf16")
    assert bitwise_equal(expected, got)
    assert got[1][-1] == "torch.float32"  # outputs come back in fp32, as Accelerate does
    assert not bitwise_equal(expected, _accelerate_run(Accelerator, "no"))


def test_accelerate_fp16_on_cpu_trains_fp32_as_accelerate_does() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from mixprec.integrations.accelerate import MixprecAccelerator

    expected = _accelerate_run(Accelerator, "fp16")
    assert bitwise_equal(expected, _accelerate_run(Accelerator, "no"))  # Accelerate: fp32 on a CPU, silently
    with pytest.warns(UserWarning, match=r"mixed_precision='fp16'\) on CPU trains in fp32"):
        got = _accelerate_run(MixprecAccelerator, "fp16")
    assert bitwise_equal(expected, got)


# --- Hugging Face Trainer -------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic sequences with a learnable rule (each token is the previous plus 3, mod 64)."""

    def __init__(self, n: int = 64, length: int = 16) -> None:
        starts = torch.randint(0, 64, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + 3 * torch.arange(length)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_run(tmp_path: Any, cls: Any, args: dict[str, Any], **kwargs: Any) -> tuple[Any, list[float]]:
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)  # built from the config: no download
    training = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=16, learning_rate=3e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **args,
    )  # fmt: skip
    trainer = cls(model=model, args=training, train_dataset=_Tokens(), **kwargs)
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def test_trainer_bf16_matches_trainer_amp(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from mixprec.integrations.transformers import MixprecTrainer

    expected, expected_losses = _trainer_run(tmp_path, transformers.Trainer, {"bf16": True})
    got, losses = _trainer_run(tmp_path, MixprecTrainer, {"bf16": True})
    assert losses == expected_losses and losses[-1] < losses[0]
    assert bitwise_equal(list(expected.model.parameters()), list(got.model.parameters()))
    _, fp32_losses = _trainer_run(tmp_path, transformers.Trainer, {})
    assert fp32_losses != losses  # the comparison can fail


def test_trainer_fp16_policy_and_scaler_are_used(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    import mixprec
    from mixprec.integrations.transformers import MixprecTrainer

    seen: dict[str, set[Any]] = {"autocast": set(), "norm": set(), "attn.c_attn": set()}

    class Recording(MixprecTrainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen["autocast"].add((mixprec.is_autocast_enabled("cpu"), mixprec.get_autocast_dtype("cpu")))
            return super().compute_loss(model, inputs, *args, **kwargs)

    def hooks(trainer: Any) -> None:
        block = trainer.model.transformer.h[0]
        block.ln_1.register_forward_hook(lambda m, a, out: seen["norm"].add(out.dtype))
        block.attn.c_attn.register_forward_hook(lambda m, a, out: seen["attn.c_attn"].add(out.dtype))

    class Hooked(Recording):  # type: ignore[misc]
        def train(self, *args: Any, **kwargs: Any) -> Any:
            hooks(self)
            return super().train(*args, **kwargs)

    trainer, losses = _trainer_run(tmp_path, Hooked, {"fp16": True}, policy="keep=norm")
    assert seen == {"autocast": {(True, torch.float16)}, "norm": {torch.float32}, "attn.c_attn": {torch.float16}}
    assert (
        isinstance(trainer.mixprec_scaler, mixprec.GradScaler) and trainer.accelerator.scaler is trainer.mixprec_scaler
    )
    assert trainer.mixprec_scaler.get_scale() > 1.0  # a loss scale, not fp32's 1
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert norms and all(0 < n < 100 for n in norms)  # clipped and logged after unscaling (x65536 otherwise)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.dtype is torch.float32 for p in trainer.model.parameters())


def test_trainer_level(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from mixprec.integrations.transformers import MixprecTrainer

    trainer, losses = _trainer_run(tmp_path, MixprecTrainer, {"bf16": True}, level="O2")
    block = trainer.model.transformer.h[0]
    seen = {}
    block.attn.c_attn.register_forward_pre_hook(  # what the projection computes with
        lambda m, a: seen.__setitem__("attn.c_attn", (m.weight.dtype, a[0].dtype))
    )
    block.ln_1.register_forward_hook(lambda m, a, out: seen.__setitem__("ln_1", (m.weight.dtype, out.dtype)))
    trainer.model(torch.randint(0, 10, (1, 4), device=trainer.model.device))
    # the norm computes in fp32 (its weight and output); the projection with its bf16 copy, on the norm's output
    assert seen == {"attn.c_attn": (torch.bfloat16, torch.float32), "ln_1": (torch.float32, torch.float32)}
    masters = trainer.optimizer.optimizer.param_groups[0]["params"]
    assert all(p.dtype is torch.float32 for p in masters)
    assert {id(p) for p in masters} <= {id(p) for p in trainer.model.parameters()}  # O2's masters are the weights
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match=r"valid: O1, O2, bf16-sr, bf16-pure, bf16-kahan, a mixprec\.PrepareConfig"):
        MixprecTrainer(level="O3")


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # Dynamo's own
def test_trainer_takes_every_level_and_a_whole_prepare_config(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    import mixprec
    from mixprec._src.optim import moments
    from mixprec._src.prepare.levels import prepared_state
    from mixprec.integrations.transformers import MixprecTrainer

    trainer, losses = _trainer_run(tmp_path, MixprecTrainer, {"bf16": True}, level="bf16-kahan")
    state = prepared_state(trainer.model)
    assert state is not None and state.level.value == "bf16-kahan" and losses[-1] < losses[0]
    config = mixprec.PrepareConfig(level="O2", optimizer_state="8bit")
    trainer, losses = _trainer_run(tmp_path, MixprecTrainer, {}, level=config)  # the config's bf16, no flag
    states = trainer.optimizer.optimizer.state.values()
    assert any(moments.is_quantized(s) for s in states) and losses[-1] < losses[0]
    with pytest.raises(ValueError, match=r"the PrepareConfig computes in torch\.bfloat16 and the Trainer in"):
        _trainer_run(tmp_path, MixprecTrainer, {}, level=config, precision="fp16")


def test_trainer_with_torch_compile_trains_as_eager(tmp_path: Any) -> None:
    # Trainer(torch_compile=True), as Hugging Face users compile: the prepared model (O2, norms kept in
    # fp32) compiled by the Trainer trains bit for bit as the eager one (aot_eager: no code generator)
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from mixprec.integrations.transformers import MixprecTrainer

    _, eager = _trainer_run(tmp_path, MixprecTrainer, {"bf16": True}, level="O2")
    torch._dynamo.reset()
    counters.clear()
    compile_args = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    _, compiled = _trainer_run(tmp_path, MixprecTrainer, {"bf16": True, **compile_args}, level="O2")
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs > 0  # the Trainer did compile the model
    assert compiled == eager


def test_save_pretrained_of_an_fp8_delayed_model_loads_into_a_plain_one(tmp_path: Any) -> None:
    # save_pretrained writes what from_pretrained loads (an unprepared model): the delayed-scaling
    # histories, training state like the optimizer's, stay out of it, and in state_dict() for a resume.
    transformers = pytest.importorskip("transformers")
    import mixprec

    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.prepare(model, opt, "O1", fp8="delayed")
    ids = torch.randint(0, 128, (4, 16))
    model(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    opt.step()
    history = {k for k in model.state_dict() if k.endswith((".fp8.history", ".fp8.pending"))}
    assert len(history) == 26  # 13 linears in fp8 (the classifier head is not), two buffers each
    model.save_pretrained(tmp_path)
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    weights = {k: v for k, v in model.state_dict().items() if k not in history}
    assert set(loaded.state_dict()) == set(weights)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())
    # a layer moved out of delayed scaling has no history left to keep out (nor one to save)
    name = "bert.encoder.layer.0.attention.self.query"
    for precision in ("bf16", "fp8-tensorwise"):
        mixprec.set_layer_precision(model, name, precision)
        assert f"{name}.fp8.history" not in model.state_dict()
        assert len(model._keys_to_ignore_on_save) == 24 and f"{name}.fp8.history" not in model._keys_to_ignore_on_save
