"""The bench's training workloads, each in three sizes.

``default`` fits the bench's 3-minute budget on a 2-core CPU, ``quick`` about a third
of it, ``tiny`` is for tests. On CUDA the default sizes grow (the checkerboard runs at
the reference's 512x512). Every workload is seeded: same model, same data in every mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

SIZES = ("tiny", "quick", "default")
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class Task:
    """One built workload: a model, its data and its loss."""

    model: nn.Module
    batch: Callable[[int], Batch]  # step -> (inputs, targets), on the device
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lr: float
    optimizer: str = "adamw"
    image: bool = False  # the output is an image worth showing beside its target


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named workload; ``build(size, device)`` makes a fresh seeded :class:`Task`."""

    name: str
    description: str
    conv: bool
    build: Callable[[str, torch.device], Task]


T = TypeVar("T")


def _pick(size: str, device: torch.device, tiny: T, quick: T, default: T, cuda: T) -> T:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    if size == "default" and device.type == "cuda":
        return cuda
    return {"tiny": tiny, "quick": quick, "default": default}[size]


# ----- checkerboard ("Effective PyTorch", mixed-precision section) --------------------


def grid(width: int, height: int) -> torch.Tensor:
    """Pixel coordinates in [0, 1), shape (2, height, width)."""
    h = torch.arange(width).unsqueeze(0).repeat([height, 1]).div(width)
    v = torch.arange(height).unsqueeze(1).repeat([1, width]).div(height)
    return torch.stack([h, v], 0)


def checker(width: int, height: int, freq: int) -> torch.Tensor:
    """A checkerboard of ``freq`` squares per side, shape (height, width), values 0 and 1."""
    h = torch.arange(width).reshape([1, width]).mul(freq / width / 2.0).fmod(1.0).gt(0.5)
    v = torch.arange(height).reshape([height, 1]).mul(freq / height / 2.0).fmod(1.0).gt(0.5)
    return h.logical_xor(v).float()


def _checkerboard(size: str, device: torch.device) -> Task:
    side = _pick(size, device, 16, 96, 128, 512)
    width = 32 if size == "tiny" else 256
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 2
    for _ in range(3):
        layers += [nn.Conv2d(channels, width, 1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    model = nn.Sequential(*layers, nn.Conv2d(width, 1, 1))
    inputs = grid(side, side).unsqueeze(0).to(device)
    targets = checker(side, side, 8).unsqueeze(0).unsqueeze(1).to(device)
    return Task(model, lambda step: (inputs, targets), F.mse_loss, lr=1e-3, optimizer="adam", image=True)


# ----- wide MLP regression ---------------------------------------------------------------


def _mlp(size: str, device: torch.device) -> Task:
    dim, hidden, batch = _pick(size, device, (32, 64, 64), (1024, 2048, 1024), (1024, 2048, 2048), (2048, 8192, 4096))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, dim)
    )
    teacher = torch.randn(dim, dim, generator=torch.Generator().manual_seed(1)) / dim**0.5

    def batch_fn(step: int) -> Batch:
        x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1000 + step))
        return x.to(device), torch.tanh(x @ teacher).to(device)

    return Task(model, batch_fn, F.mse_loss, lr=1e-3)


# ----- small causal transformer on generated text ---------------------------------------


def markov_text(length: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    """A token stream from a fixed random second-order Markov source with 4 likely successors per context.

    Learnable structure (about 2 bits per token) without shipping a corpus.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, vocab, 4), generator=g)
    choices = torch.randint(0, 4, (length,), generator=g)
    noise = torch.rand(length, generator=g) < 0.05
    random_tokens = torch.randint(0, vocab, (length,), generator=g)
    out: list[int] = []
    a, b = 0, 1
    choice_list, noise_list, random_list = choices.tolist(), noise.tolist(), random_tokens.tolist()
    table = successors.tolist()
    for i in range(length):
        nxt = random_list[i] if noise_list[i] else table[a][b][choice_list[i]]
        out.append(nxt)
        a, b = b, nxt
    return torch.tensor(out, dtype=torch.long)


class TinyLM(nn.Module):
    """A pre-norm causal transformer language model."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        hidden = self.blocks(self.embed(tokens), mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(hidden))
        return out


def _transformer(size: str, device: torch.device) -> Task:
    dim, layers, seq, batch = _pick(
        size, device, (32, 1, 16, 4), (512, 2, 96, 16), (1024, 2, 128, 16), (768, 4, 256, 32)
    )
    vocab = 256
    torch.manual_seed(0)
    model = TinyLM(vocab, dim, layers, heads=max(1, dim // 64))
    text = markov_text(200_000 if size != "tiny" else 5_000)

    def batch_fn(step: int) -> Batch:
        starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=torch.Generator().manual_seed(step))
        window = torch.stack([text[s : s + seq + 1] for s in starts.tolist()])
        return window[:, :-1].to(device), window[:, 1:].to(device)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Task(model, batch_fn, loss_fn, lr=1e-3)


# ----- small ResNet-style classifier on synthetic images ---------------------------------


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.skip(x))


class SmallResNet(nn.Module):
    """Stem, one residual block per stage (stride 2 after the first), pooling, a linear head."""

    def __init__(self, widths: tuple[int, ...], classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, cin = [], widths[0]
        for i, width in enumerate(widths):
            stages.append(_Block(cin, width, 1 if i == 0 else 2))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))
        return out


def _cnn(size: str, device: torch.device) -> Task:
    widths, side, batch = _pick(
        size, device, ((8, 16), 8, 8), ((32, 64, 128), 32, 64), ((64, 128, 256), 32, 64), ((64, 128, 256, 512), 64, 256)
    )
    classes = 10
    torch.manual_seed(0)
    model = SmallResNet(widths, classes)
    g = torch.Generator().manual_seed(2)
    # Smooth class templates: learnable, but noisy enough that the loss keeps falling.
    templates = F.interpolate(torch.randn(classes, 3, 4, 4, generator=g), size=side, mode="bilinear")

    def batch_fn(step: int) -> Batch:
        gs = torch.Generator().manual_seed(5000 + step)
        labels = torch.randint(0, classes, (batch,), generator=gs)
        images = templates[labels] + torch.randn(batch, 3, side, side, generator=gs)
        return images.to(device), labels.to(device)

    return Task(model, batch_fn, F.cross_entropy, lr=1e-3)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("checkerboard", "1x1-conv net learns a checkerboard from pixel coordinates", True, _checkerboard),
        Workload("mlp", "wide MLP regression onto a random teacher", False, _mlp),
        Workload("transformer", "causal transformer LM on generated Markov text", False, _transformer),
        Workload("cnn", "small ResNet-style classifier on synthetic images", True, _cnn),
    )
}
