"""A config-built Llama trained at each level, at a realistic size: ``mixprec bench --llama``.

Hugging Face's ``LlamaForCausalLM`` made from a config (nothing downloaded). At the default size it has about
1.1B parameters (width 2048, 16 layers, 32 heads sharing 8 key-value heads, MLP 8192, vocabulary 32000) and
trains on sequences of 2048 tokens; ``quick`` is a 0.2B model at 1024 tokens, ``tiny`` a few thousand
parameters (what the tests run on the CPU). The batch is the size's own, or on CUDA with ``batch=None`` the
largest of 16, 8, 4, 2, 1 whose step fits (:func:`fit_batch`).

Each recipe trains its own copy of one fp32 model with torch's fused AdamW: torch.amp's autocast (bf16), each
``prepare`` level, and fp8 linears (``O1+fp8``: ``O1`` with ``fp8="tensorwise"``, measured against ``O1``: the same
autocast, its GEMMs in fp8). With ``compiled`` each also runs as ``torch.compile(model)`` against compiled
torch.amp. Per recipe: the median step (forward, loss, backward, ``optimizer.step()``; on CUDA waited for
before and after, the benchmark's sync), tokens a second, the ratio to its baseline, the peak of memory the
recipe allocated on CUDA (above what was allocated before its model was copied) and the bytes it holds between
steps (``memory_report``: weights, masters, gradients, optimizer state), the last loss. Each row is printed
as it is measured, so an interrupted run keeps the rows it finished. Ratios from one run are figures to read.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

__all__ = [
    "HEADER",
    "RECIPES",
    "SIZES",
    "WARMUP",
    "LlamaRecipe",
    "LlamaRow",
    "Shape",
    "fit_batch",
    "llama",
    "measure",
    "table_row",
]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama's config and its training batch."""

    vocab: int
    width: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    batch: int  # on the CPU, and on CUDA where no batch is fitted

    def parameters(self) -> int:
        """Its parameter count (untied embedding and head, RMSNorms)."""
        head_dim = self.width // self.heads
        attention = 2 * self.width * self.width + 2 * self.width * self.kv_heads * head_dim
        block = attention + 3 * self.width * self.mlp + 2 * self.width
        return 2 * self.vocab * self.width + self.layers * block + self.width


SIZES: dict[str, Shape] = {
    "tiny": Shape(vocab=256, width=64, mlp=128, layers=2, heads=4, kv_heads=2, seq=64, batch=2),
    "quick": Shape(vocab=32000, width=1024, mlp=4096, layers=8, heads=16, kv_heads=4, seq=1024, batch=4),
    "default": Shape(vocab=32000, width=2048, mlp=8192, layers=16, heads=32, kv_heads=8, seq=2048, batch=4),
}


@dataclasses.dataclass(frozen=True)
class LlamaRecipe:
    """One way to train: torch.amp's autocast (``level`` None) or ``prepare`` at ``level`` with ``fp8``."""

    name: str
    level: str | None = None
    fp8: str | None = None
    baseline: str = "torch-amp"  # the row its ratio is taken against (compiled: the compiled one)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.level is None:
            return model, optimizer
        options: dict[str, Any] = {} if self.fp8 is None else {"fp8": self.fp8}
        return mixprec.prepare(model, optimizer, level=self.level, **options)


RECIPES: tuple[LlamaRecipe, ...] = (
    LlamaRecipe("torch-amp"),
    LlamaRecipe("O1", "O1"),
    LlamaRecipe("O2", "O2"),
    LlamaRecipe("bf16-pure", "bf16-pure"),
    LlamaRecipe("bf16-sr", "bf16-sr"),
    LlamaRecipe("O1+fp8", "O1", fp8="tensorwise", baseline="O1"),
)


@dataclasses.dataclass
class LlamaRow:
    recipe: str
    compiled: bool
    baseline: str
    batch: int
    seq: int
    step_ms: float
    tokens_per_s: float
    held_bytes: int  # memory_report's total after the steps
    peak_bytes: int | None  # on CUDA: the recipe's own peak; None elsewhere
    loss: float
    vs_baseline: float | None = None


#: steps before the timed ones (compiling in the first, a fused AdamW's state made), as many eager as compiled: the
#: last losses of one recipe compare
WARMUP = 3
HEADER = ("recipe", "compiled", "batch x seq", "step ms", "tokens/s", "vs", "held", "peak", "last loss")


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table_row(row: LlamaRow) -> list[str]:
    """``row`` as the table's cells."""
    ratio = "-" if row.vs_baseline is None else f"{row.vs_baseline:.2f}x {row.baseline}"
    peak = "-" if row.peak_bytes is None else _bytes(row.peak_bytes)
    return [
        row.recipe,
        "yes" if row.compiled else "no",
        f"{row.batch} x {row.seq}",
        f"{row.step_ms:.1f}",
        f"{row.tokens_per_s:,.0f}",
        ratio,
        _bytes(row.held_bytes),
        peak,
        f"{row.loss:.3f}",
    ]


def llama(shape: Shape, device: torch.device | str = "cpu") -> nn.Module:
    """An fp32 ``LlamaForCausalLM`` of ``shape``, made on ``device`` (seeded: every call the same weights)."""
    try:
        with _quiet_imports():  # transformers imports torchao where it is installed, which logs as it loads
            import transformers

            transformers.LlamaForCausalLM  # noqa: B018 (a lazy module: the attribute imports it)
    except ImportError as exc:  # an optional dependency: the extra "transformers"
        raise ValueError(
            "mixprec bench --llama builds Hugging Face's Llama: pip install 'mixprec[transformers]'"
        ) from exc
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.width,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"  # torch's fused attention, as users of Llama train it
    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """torchao's and torch's pytree loggers held to errors: torchao logs each CUDA library it cannot load (all of
    them on a CPU machine) and registers enums torch's pytree warns about, lines that say nothing about the bench."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _batch(shape: Shape, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (batch, shape.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


class _Run:
    """One recipe's copy of the model, its optimizer and its step."""

    def __init__(self, base: nn.Module, recipe: LlamaRecipe, compiled: bool) -> None:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.model, self.optimizer = recipe.prepare(model, optimizer)
        self.recipe = recipe
        self.call: Callable[..., Any] = torch.compile(self.model) if compiled else self.model

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=self.recipe.level is None):
            logits = self.call(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return loss.detach()


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fit_batch(base: nn.Module, shape: Shape, device: torch.device, recipes: Iterable[LlamaRecipe]) -> int:
    """The largest of 16, 8, 4, 2, 1 at which one step of every recipe in ``recipes`` fits in 90% of the GPU
    (each tried once, eagerly; out of memory: the next smaller). On the CPU: ``shape.batch``."""
    if device.type != "cuda":
        return shape.batch
    total = torch.cuda.get_device_properties(device).total_memory
    for batch in (16, 8, 4, 2, 1):
        fits = True
        for recipe in recipes:
            _release(device)
            torch.cuda.reset_peak_memory_stats(device)
            run = None
            try:
                run = _Run(base, recipe, compiled=False)
                run.step(*_batch(shape, batch, device))
                _wait(device)
                fits = torch.cuda.max_memory_allocated(device) < 0.9 * total
            except torch.OutOfMemoryError:
                fits = False
            del run
            if not fits:
                break
        if fits:
            _release(device)
            return batch
    raise ValueError(f"not even a batch of 1 fits on {device} at this size; use a smaller --size")


def measure(
    recipes: Iterable[LlamaRecipe] = RECIPES,
    size: str = "default",
    steps: int = 5,
    device: torch.device | str = "cpu",
    batch: int | None = None,
    compiled: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Iterator[LlamaRow]:
    """Train each recipe (eager, then compiled where ``compiled``) for :data:`WARMUP` steps and ``steps`` timed ones;
    yields each row as it is measured, its ratio to its baseline's row where that came first."""
    device = torch.device(device)
    shape = SIZES[size]
    chosen = tuple(recipes)
    base = llama(shape, device)
    if batch is None:
        if progress is not None:
            progress("fitting the batch")
        batch = fit_batch(base, shape, device, chosen)
    inputs, targets = _batch(shape, batch, device)
    done: dict[tuple[str, bool], LlamaRow] = {}
    for is_compiled in (False, True) if compiled else (False,):
        for recipe in chosen:
            if progress is not None:
                progress(f"{recipe.name}{' compiled' if is_compiled else ''}")
            _release(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            run = _Run(base, recipe, is_compiled)
            times, loss = [], torch.zeros(())
            for i in range(WARMUP + steps):
                _wait(device)
                start = time.perf_counter()
                loss = run.step(inputs, targets)
                _wait(device)
                if i >= WARMUP:
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
            row = LlamaRow(
                recipe.name,
                is_compiled,
                recipe.baseline,
                batch,
                shape.seq,
                seconds * 1e3,
                batch * shape.seq / seconds,
                mixprec.memory_report(run.model, run.optimizer).total,
                peak,
                float(loss),
            )
            against = done.get((recipe.baseline, is_compiled))
            if against is not None and recipe.name != recipe.baseline:
                row.vs_baseline = against.step_ms / row.step_ms
            done[recipe.name, is_compiled] = row
            del run
            yield row
