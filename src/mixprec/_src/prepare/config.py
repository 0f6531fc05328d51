"""What :func:`mixprec.prepare` does to a model, as one value: :class:`PrepareConfig`.

``prepare(model, optimizer, "O2")`` and ``prepare(model, optimizer, PrepareConfig(level="O2", ...))``
do the same; the config is what integrations, :meth:`mixprec.Recipe.apply` and user code pass
around, print and compare. Options of new precision formats and distributed engines join it as
fields: the one place a model's conversion is described.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from mixprec._src.dtypes import LOW_PRECISION, NamedEnum, parse_dtype, short_name
from mixprec._src.fp8.config import Fp8Config, as_fp8_config
from mixprec._src.optim.state_precision import StatePrecision
from mixprec._src.policy.grammar import get_policy
from mixprec._src.policy.rules import NORM_TYPES, ModuleFilter, ModuleRule, Policy, rule_items

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["Level", "PrepareConfig", "PrepareOptions", "StatePrecision"]


class Level(NamedEnum):
    """Precision levels of :func:`mixprec.prepare`."""

    O1 = "O1"
    O2 = "O2"
    BF16_SR = "bf16-sr"
    BF16_PURE = "bf16-pure"
    BF16_KAHAN = "bf16-kahan"

    @property
    def bf16_weights(self) -> bool:
        """Whether the level stores the weights themselves in bf16 (no fp32 master)."""
        return self in (Level.BF16_SR, Level.BF16_PURE, Level.BF16_KAHAN)

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "level", "levels"


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """How :func:`mixprec.prepare` converts a model and its optimizer.

    Attributes:
        level: ``"O1"``, ``"O2"``, ``"bf16-sr"``, ``"bf16-kahan"`` or ``"bf16-pure"`` (see :func:`mixprec.prepare`).
        dtype: the low precision (bf16 or fp16; the bf16 levels need bf16).
        keep_types: module types kept in fp32 (stored and computed); norm layers by default.
        keep_names: qualified-name globs of modules kept in fp32 (``"head"``, ``"blocks.*.attn"``).
        keep_filter: ``(module, name) -> bool``; a module it accepts is kept in fp32 too.
        output_dtype: the model's floating outputs are cast to this (``None``: as computed).
        policy: the autocast policy the prepared forward runs under (a :class:`Policy` or a
            policy string); ``None``: the device's built-in lists.
        fp8: linears that compute in fp8 (a recipe name or an :class:`Fp8Config`); ``None``: none.
            Modules kept in fp32 stay out of fp8.
        optimizer_state: the precision of Adam's and AdamW's moments and SGD's momentum: ``"fp32"`` (as the level
            keeps them), ``"bf16"`` (bf16 tensors, stochastically rounded), ``"8bit"``, ``"4bit"`` or ``"fp8"``
            (block-wise quantized, torchao's formats); for parameters of 4096 values or more.
        step_in_backward: step each parameter during backward, as soon as its gradient is whole, and free
            the gradient (gradients never occupy memory for the whole model); ``optimizer.step()`` then
            finishes the step (the small parameters, biases and norms, are stepped there together). No
            gradient accumulation over backwards, no fp16 (no GradScaler).
        clip_grad_norm: clip gradients to this global norm before each step (``None``: prepare does not
            clip). With ``step_in_backward``, by the previous step's norm or this backward's so far,
            whichever is larger (see :func:`mixprec.grad_norm`).

    Raises:
        ValueError: a bad level or dtype, or a bf16 level with another dtype (at construction).
    """

    level: Level = Level.O2
    dtype: torch.dtype = torch.bfloat16
    keep_types: tuple[type[nn.Module], ...] = NORM_TYPES
    keep_names: tuple[str, ...] = ()
    keep_filter: ModuleFilter | None = None
    output_dtype: torch.dtype | None = torch.float32
    policy: Policy | None = None
    fp8: Fp8Config | None = None
    optimizer_state: StatePrecision = StatePrecision.FP32
    step_in_backward: bool = False
    clip_grad_norm: float | None = None
    # What keep_types and keep_names match, built once in __post_init__.
    _rule: ModuleRule | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        level = Level.from_name(self.level)
        dtype = parse_dtype(self.dtype, what="prepare dtype", allowed=LOW_PRECISION)
        if level.bf16_weights and dtype is not torch.bfloat16:
            raise ValueError(
                f"level {level.value!r} keeps weights in bf16; pass dtype=torch.bfloat16 (or use level 'O2')"
            )
        types: Any = self.keep_types
        names: Any = self.keep_names
        object.__setattr__(self, "level", level)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "keep_types", (types,) if isinstance(types, type) else tuple(types))
        object.__setattr__(self, "keep_names", (names,) if isinstance(names, str) else tuple(names))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", parse_dtype(self.output_dtype, what="output dtype"))
        if self.policy is not None:
            object.__setattr__(self, "policy", get_policy(self.policy))
        object.__setattr__(self, "fp8", as_fp8_config(self.fp8))  # type: ignore[arg-type]
        if not isinstance(self.optimizer_state, str):
            raise TypeError(
                f"optimizer_state takes a name such as 'bf16' or a StatePrecision, not {self.optimizer_state!r}"
            )
        object.__setattr__(self, "optimizer_state", StatePrecision.from_name(self.optimizer_state))
        if any(not isinstance(name, str) for name in self.keep_names):
            raise TypeError(f"keep_names takes qualified-name globs (strings), not {self.keep_names!r}")
        if self.clip_grad_norm is not None:
            if not isinstance(self.clip_grad_norm, (int, float)) or not 0 < self.clip_grad_norm < float("inf"):
                raise ValueError(f"clip_grad_norm must be a positive finite number, not {self.clip_grad_norm!r}")
            object.__setattr__(self, "clip_grad_norm", float(self.clip_grad_norm))
        if not isinstance(self.step_in_backward, bool):  # "no" or "false" would read as true
            raise TypeError(f"step_in_backward takes True or False, not {self.step_in_backward!r}")
        if self.step_in_backward and dtype is torch.float16:
            raise ValueError(
                "step_in_backward=True steps each parameter during backward, before a GradScaler "
                "could see every gradient, so a step with inf/NaN gradients could not be skipped: "
                "fp16 needs that. Use dtype=torch.bfloat16 (no loss scaling needed), or "
                "step_in_backward=False"
            )
        if self.keep_filter is not None and not callable(self.keep_filter):
            raise TypeError("keep_filter must be a callable (module, qualified_name) -> bool")
        rule = ModuleRule(self.keep_types, self.keep_names) if (self.keep_types or self.keep_names) else None
        object.__setattr__(self, "_rule", rule)  # checks the types are modules

    @classmethod
    def of(cls, level: Level | str = Level.O2, **options: Any) -> PrepareConfig:
        """The config of ``prepare(model, optimizer, level, **options)``: the options by keyword, each field's
        default where not given.

        Raises:
            TypeError: an option that is not a field (the message lists them), or a value of the wrong type.
        """
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; prepare takes {', '.join(OPTIONS)}")
        return cls(level=Level.from_name(level), **options)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A pickle of an older version (choices stored as strings) loads with its choices parsed."""
        self.__dict__.update(state)
        if isinstance(state.get("optimizer_state"), str):
            object.__setattr__(self, "optimizer_state", StatePrecision.from_name(state["optimizer_state"]))
        if isinstance(state.get("level"), str):
            object.__setattr__(self, "level", Level.from_name(state["level"]))

    def keeps(self, module: nn.Module, name: str) -> bool:
        """Whether ``module``, called ``name`` in the model, is kept in fp32."""
        if self._rule is not None and self._rule.matches(module, name):
            return True
        return self.keep_filter is not None and bool(self.keep_filter(module, name))

    def __str__(self) -> str:
        """One line, e.g. ``O2 bf16, keep=norm, output=fp32``."""
        kept = rule_items(self._rule) if self._rule is not None else []
        if self.keep_filter is not None:
            kept.append(getattr(self.keep_filter, "__name__", "filter"))
        parts = [f"{self.level.value} {short_name(self.dtype)}", f"keep={'+'.join(kept) or '-'}"]
        parts.append(f"output={short_name(self.output_dtype)}")
        if self.policy is not None:
            parts.append(f"policy={self.policy}")
        if self.fp8 is not None:
            parts.append(str(self.fp8))
        if self.optimizer_state.own:
            parts.append(f"state={self.optimizer_state}")
        if self.step_in_backward:
            parts.append("step-in-backward")
        if self.clip_grad_norm is not None:
            parts.append(f"clip={self.clip_grad_norm:g}")
        return ", ".join(parts)


#: The options ``prepare`` takes beside ``level``: :class:`PrepareConfig`'s fields, in order.
OPTIONS = tuple(f.name for f in dataclasses.fields(PrepareConfig) if f.init and f.name != "level")


class PrepareOptions(TypedDict, total=False):
    """``prepare``'s keyword options beside ``level`` and ``dtype``, for type checkers (:class:`PrepareConfig`'s
    fields describe each)."""

    keep_types: type[nn.Module] | Iterable[type[nn.Module]]
    keep_names: str | Iterable[str]
    keep_filter: ModuleFilter | None
    output_dtype: torch.dtype | str | None
    policy: Policy | str | None
    fp8: Fp8Config | str | None
    optimizer_state: StatePrecision | str
    step_in_backward: bool
    clip_grad_norm: float | None
