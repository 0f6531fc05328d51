"""Turning a model's GEMM layers of linear kinds into fp8 layers: which ones, which not and why, and their step.

The layers are :func:`mixprec._src.gemms.sites.gemm_layers`': ``nn.Linear`` and its forwarding
subclasses, transformers' ``Conv1D`` (weight transposed, computed as the same ``nn.Linear``),
an ``nn.MultiheadAttention``'s packed in-projection and its ``out_proj`` (the attention routed so
that both run as modules); a convolution stays in its dtype.

:func:`convert` is what :func:`mixprec.prepare` calls with ``PrepareConfig.fp8``; it applies
CUDA's rules on every device (a layer whose features are not multiples of 16 is left out, with
the reason), so a recipe tested on a CPU runs on a GPU. :func:`mixprec.fp8_layers` lists what was
converted and what was left out. With delayed scaling, :func:`advance` ends an optimizer step: the
layers' pending amaxes are all-reduced (max) across ranks in one collective, then join their
histories, so every rank holds the same scaling state (a checkpoint saves it once).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec._src import bound_forward
from mixprec._src.fp8 import gemm as fp8_gemm
from mixprec._src.fp8.config import Fp8Config, Fp8Recipe
from mixprec._src.fp8.linear import Fp8Scaling, fp8_forward
from mixprec._src.gemms import kinds, sites

__all__ = [
    "advance",
    "check_device",
    "convert",
    "drop_foreign_fp8_state",
    "fp8_layers",
    "Fp8Layers",
    "is_converted",
    "kept_last",
    "keep_out_of_save_pretrained",
    "reason_to_skip",
    "revert",
    "revert_layer",
    "scaling_of",
    "set_layer",
]

_ATTR = "_mixprec_fp8"  # the Fp8Layers of a converted model, on the model
logger = logging.getLogger("mixprec.fp8")


@dataclasses.dataclass
class Fp8Layers:
    """The fp8 layers of a model: converted (by qualified name) and left out (name, reason).

    Attributes:
        config: the fp8 config applied.
        converted: qualified names of the layers that compute in fp8.
        skipped: ``(qualified name, reason)`` of each GEMM layer left in its dtype, and of each module
            holding a GEMM's weight that is not a layer (``gemms.sites.left_out``).
        flops_per_row: per layer (converted or skipped), its GEMM's FLOPs per row (token): ``2 * in * out``.
        kept: ``(qualified name, class name)`` of each module the prepare config keeps in fp32 (the norms, by
            default: torch's and, by class name, other libraries'), whose GEMMs stay out of fp8.
    """

    config: Fp8Config
    converted: list[str]
    skipped: list[tuple[str, str]]
    modules: dict[str, nn.Module] = dataclasses.field(repr=False, default_factory=dict)
    flops_per_row: dict[str, int] = dataclasses.field(repr=False, default_factory=dict)
    kept: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def share(self) -> float:
        """The converted layers' share of the layers' GEMM FLOPs per row (each layer seeing every token once).

        A forward's real shares, by the rows each layer saw, are ``mixprec.gemm_reach(model, batch)``'s.
        """
        total = sum(self.flops_per_row.values())
        return sum(self.flops_per_row.get(n, 0) for n in self.converted) / total if total else 0.0

    def __str__(self) -> str:
        lines = [
            f"{self.config}: {len(self.converted)} layer(s) in {self.config.recipe if self.config.block else 'fp8'}, "
            f"{len(self.skipped)} left out"
            + (f"; {self.share():.1%} of the GEMM FLOPs per token" if self.flops_per_row else "")
        ]
        lines += [f"  {name or '<model>'}: {reason}" for name, reason in self.skipped]
        if self.kept:
            classes = collections.Counter(cls for _, cls in self.kept)
            lines.append(
                f"kept in fp32: {len(self.kept)} module(s): " + ", ".join(f"{cls} x{n}" for cls, n in classes.items())
            )
        return "\n".join(lines)

    def scalings(self) -> list[tuple[str, Fp8Scaling]]:
        """``(name, Fp8Scaling)`` of each converted layer."""
        return [(name, module.fp8) for name, module in self.modules.items()]  # type: ignore[misc]


_UNSAVED = "_mixprec_fp8_unsaved"  # the keys keep_out_of_save_pretrained added to _keys_to_ignore_on_save


def fp8_layers(model: nn.Module) -> Fp8Layers | None:
    """What fp8 conversion did to ``model`` (converted and skipped layers), or ``None`` if none ran."""
    layers: Fp8Layers | None = model.__dict__.get(_ATTR)
    return layers


def reason_to_skip(module: nn.Module, name: str, config: Fp8Config, kept: bool, head: str | None) -> str | None:
    """Why fp8 conversion leaves this GEMM layer in its dtype, or ``None``."""
    kind = kinds.kind_of(module)
    if kind is None:
        return kinds.not_a_layer(module) or f"{type(module).__name__} is not a GEMM layer"
    if not kind.linear:
        return f"a {kind} layer: fp8 computes the GEMMs of linear kinds (linear, conv1d, attention projections)"
    if not config.selects(module, name):
        return "not selected by the fp8 names or filter"
    if kept:
        return "kept in fp32 by the prepare config"
    if name == head and not config.convert_head:
        return "the output head (the last linear; Fp8Config(convert_head=True) converts it)"
    features = tuple(zip(("in_features", "out_features"), kinds.features(module), strict=True))
    misaligned = [f"{what} {n}" for what, n in features if n % fp8_gemm.ALIGN]
    if misaligned:
        return f"{' and '.join(misaligned)} not a multiple of {fp8_gemm.ALIGN}, which fp8 GEMMs on CUDA need"
    return None


def check_device(model: nn.Module, config: Fp8Config) -> None:
    """Raise where the model's GPU has no fp8 GEMMs for ``config``'s recipe (host-side, no sync)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(param.device)
    rowwise = config.recipe in (Fp8Recipe.ROWWISE, Fp8Recipe.ROWWISE_WITH_GW_HP)
    need = (9, 0) if rowwise else (8, 9)
    if (major, minor) < need:
        raise ValueError(
            f"fp8 recipe {config.recipe.value!r} needs a GPU of compute capability {need[0]}.{need[1]} or newer "
            f"(this one is {major}.{minor}); use recipe 'tensorwise' (8.9+) or train without fp8"
        )


def convert(
    model: nn.Module, config: Fp8Config, kept: set[int], kept_names: Iterable[tuple[str, str]] = ()
) -> Fp8Layers:
    """Give the chosen GEMM layers of ``model`` an fp8 forward (in place); ``kept``: ids of modules kept in fp32
    (``kept_names``: the outermost of them, named for the report).

    Routes the model's attentions (``gemms.attention``) so their projections are layers; a module kept in
    fp32 keeps what it holds (its attention's in-projection included).
    """
    check_device(model, config)
    found = sites.gemm_layers(model)
    kept = kept | {id(m) for _, m, _ in found if id(getattr(m, "owner", None)) in kept}
    head = head_of(model, found)
    layers = Fp8Layers(config, [], [], kept=list(kept_names))
    reasons: dict[str, str | None] = {}
    for name, module, _ in found:
        if not is_converted(module):
            reasons[name] = reason_to_skip(module, name, config, id(module) in kept, head)
            if "forward" in module.__dict__:  # the user's choice stands
                reasons[name] = (
                    "its forward is its own (mixprec.set_layer_precision, or another library's): left as it is"
                )
    for name in kept_last(config, [n for n, r in reasons.items() if r is None]):
        reasons[name] = (
            f"one of the last {config.kept_fraction:.0%} of the selected layers, which {config.recipe.value} leaves "
            "in high precision (Fp8Config(keep_last=0) converts them)"
        )
    for name, module, _ in found:
        layers.flops_per_row[name] = kinds.flops_per_row(module)
        if is_converted(module):  # given its own fp8 recipe before (mixprec.set_layer_precision): it keeps it
            layers.converted.append(name)
            layers.modules[name] = module
            continue
        reason = reasons[name]
        if reason is not None:
            layers.skipped.append((name, reason))
            continue
        module.fp8 = Fp8Scaling(config, kinds.weight_of(module).device)
        bound_forward.bind(module, fp8_forward)
        layers.converted.append(name)
        layers.modules[name] = module
    layers.skipped += sites.left_out(model)
    model.__dict__[_ATTR] = layers
    keep_out_of_save_pretrained(model)
    sites.settle(model)
    logger.info("%s", layers)
    if not layers.converted:
        warnings.warn(
            f"fp8 was asked for but no layer was converted ({len(layers.skipped)} left out); "
            "mixprec.fp8_layers(model) lists them with the reasons",
            UserWarning,
            stacklevel=3,
        )
    return layers


def kept_last(config: Fp8Config, candidates: list[str]) -> list[str]:
    """The layers (of ``candidates``, in the model's order) a recipe with ``keep_last`` leaves in high precision:
    the last ``keep_last`` fraction of them, rounded, at least one (none for a recipe without the option)."""
    if not config.kept_fraction or not candidates:
        return []
    count = max(1, round(config.kept_fraction * len(candidates)))
    return candidates[-count:]


def head_of(model: nn.Module, found: list[tuple[str, nn.Module, kinds.Kind]]) -> str | None:
    """The output head: the last GEMM layer of a linear kind that is not an attention's projection."""
    linear = [n for n, _, k in found if k.linear and sites.attention_of(model, n) is None]
    return linear[-1] if linear else None


def is_converted(module: nn.Module) -> bool:
    """Whether ``module`` is a layer with an fp8 forward."""
    return bound_forward.bound_function(module) is fp8_forward


def scaling_of(module: nn.Module) -> Fp8Scaling | None:
    """The :class:`Fp8Scaling` of a converted layer, else ``None``."""
    scaling = module._modules.get("fp8")
    return scaling if isinstance(scaling, Fp8Scaling) and is_converted(module) else None


def set_layer(model: nn.Module, name: str, config: Fp8Config | None) -> None:
    """Convert one GEMM layer of ``model`` with ``config`` (another recipe: its scaling state starts afresh),
    or, with ``None``, give it back its own forward (in place).

    Raises:
        ValueError: a layer fp8 cannot convert (not of a linear kind, a subclass with its own forward,
            features not multiples of 16), or a model whose fp8 weights are all-gathered in fp8 (their
            gather is set per layer).
    """
    sites.gemm_layers(model)  # routes the attentions: their projections are layers
    module = model.get_submodule(name)
    layers = fp8_layers(model)
    if layers is not None and layers.config.all_gather:
        raise ValueError(
            "the fp8 layers of this model are all-gathered in fp8 (Fp8Config(all_gather=True)); "
            "a layer's fp8 recipe cannot change there: prepare without all_gather"
        )
    if config is None:
        if layers is not None and name in layers.modules:
            revert_layer(layers, name, "moved out of fp8")
            keep_out_of_save_pretrained(model)
        return
    reason = reason_to_skip(module, name, dataclasses.replace(config, names=("*",), filter=None), False, None)
    if reason is not None:
        raise ValueError(f"{name!r} cannot compute in fp8: {reason}")
    if layers is None:
        layers = model.__dict__[_ATTR] = Fp8Layers(config, [], [])
    old = scaling_of(module)
    scaling = Fp8Scaling(config, kinds.weight_of(module).device)
    scaling.recording = old is not None and old.recording
    module.fp8 = scaling
    bound_forward.bind(module, fp8_forward)
    layers.skipped = [(n, r) for n, r in layers.skipped if n != name]
    if name not in layers.modules:
        layers.converted.append(name)
    layers.modules[name] = module
    layers.flops_per_row.setdefault(name, kinds.flops_per_row(module))
    keep_out_of_save_pretrained(model)
    sites.settle(model)


def revert_layer(layers: Fp8Layers, name: str, reason: str) -> None:
    """One converted layer computes as ``nn.Linear`` again, listed as left out for ``reason``."""
    module = layers.modules.pop(name)
    del module.fp8
    module.__dict__.pop("forward", None)
    layers.converted.remove(name)
    layers.skipped.append((name, reason))


def revert(model: nn.Module) -> None:
    """Undo :func:`convert`: the layers compute with their own forwards again; the fp8 state is dropped."""
    layers = model.__dict__.pop(_ATTR, None)
    if layers is None:
        return
    for module in layers.modules.values():
        del module.fp8
        module.__dict__.pop("forward", None)
    keep_out_of_save_pretrained(model)


def keep_out_of_save_pretrained(model: nn.Module) -> None:
    """Keep the delayed-scaling amax histories of a Hugging Face model out of what ``save_pretrained`` writes.

    ``save_pretrained`` writes the weights a model loads with ``from_pretrained``, which is not prepared:
    the histories are training state (as the optimizer's is) it would report as unexpected keys. They
    stay in ``state_dict()``, so ``torch.save``, DCP and :func:`mixprec.prepare`'s resume keep them.
    Through the model's own ``_keys_to_ignore_on_save`` (a transformers model's per-instance set);
    other models are left alone. Called whenever the model's fp8 layers change.
    """
    ignore = model.__dict__.get("_keys_to_ignore_on_save")
    if not isinstance(ignore, set):
        return
    delayed = [n for n, m in model.named_modules() if isinstance(m, Fp8Scaling) and m.config.delayed]
    now = {f"{name}.{buffer}" for name in delayed for buffer in ("history", "pending")}
    ignore -= model.__dict__.get(_UNSAVED, set()) - now
    ignore |= now
    model.__dict__[_UNSAVED] = now


def advance(layers: Fp8Layers, group: Any = None) -> None:
    """End of an optimizer step (delayed scaling): all-reduce the pending amaxes (max), roll the histories.

    One collective for all layers where a process group of more than one rank is up; no sync.
    """
    scalings = [s for _, s in layers.scalings() if s.config.delayed]
    if not scalings:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        pending = torch.stack([s.pending for s in scalings])
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
        for s, row in zip(scalings, pending, strict=True):
            s.pending.copy_(row)
    for s in scalings:
        s.advance()


def drop_foreign_fp8_state(model: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A load-state-dict pre-hook: fp8 amax histories (and stochastic rounding's counters) of layers that keep none
    here are ignored.

    A checkpoint of a delayed-scaling (or nvfp4) recipe then loads into a bf16 (or another fp8) recipe of the
    same model; its weights are the same full-precision tensors.
    """
    for key in [k for k in state_dict if k.endswith((".fp8.history", ".fp8.pending", ".fp8.noise"))]:
        if not key.startswith(prefix):
            continue
        try:
            target = model.get_submodule(key[len(prefix) :].rsplit(".", 2)[0])
        except AttributeError:  # not this model's layer: strict loading reports it
            continue
        scaling = getattr(target, "fp8", None)
        if not isinstance(scaling, Fp8Scaling) or key.rsplit(".", 1)[1] not in scaling._buffers:
            del state_dict[key]
