"""A precision recipe as data: what :func:`mixprec.tune` chose, how it was measured, and how to apply it.

A :class:`Recipe` holds a compute dtype, op moves into fp32, modules kept in fp32, a memory
layout, a :func:`mixprec.prepare` level and the :class:`Measurement` of every candidate;
it round-trips through JSON and applies to a model on any machine (:meth:`Recipe.apply`).
:class:`Tolerance` is the accuracy guard the candidates were held to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mixprec._src import input_checks
from mixprec._src.amp.autocast import autocast
from mixprec._src.dtypes import parse_dtype, short_name
from mixprec._src.fp8.config import Fp8Recipe, as_fp8_config
from mixprec._src.layers import choice as layer_choice
from mixprec._src.layers.choice import LayerChoice
from mixprec._src.layers.precision import LayerPrecision
from mixprec._src.layout import to_channels_last
from mixprec._src.op_names import op_name
from mixprec._src.policy.rules import Policy, default_policy
from mixprec._src.prepare.config import Level, PrepareConfig, StatePrecision
from mixprec._src.prepare.levels import prepare, prepared_state
from mixprec._src.scaling.scaler import GradScaler
from mixprec._src.tune import tables
from mixprec._src.tune.measurement import Measurement, Tolerance

__all__ = ["LAYOUTS", "Applied", "Measurement", "Recipe", "Tolerance"]

#: The memory layouts a recipe can ask for.
LAYOUTS = ("contiguous", "channels_last")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A precision recipe: what :func:`tune` chose, as data; :meth:`apply` puts it to work.

    Attributes:
        dtype: the compute dtype (``torch.float32``: no mixed precision).
        fp32_ops: ATen ops moved into fp32 on top of the device's built-in policy.
        keep_fp32: qualified-name globs of modules kept in fp32.
        layout: ``"contiguous"`` or ``"channels_last"`` (weights and 4-D/5-D inputs).
        level: a :func:`mixprec.prepare` level; ``"O1"`` is autocast alone.
        compile: whether to ``torch.compile`` the model (never chosen by the search; see the module docstring).
        fp8: the fp8 recipe of the model's linears (``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"``, ``"delayed"``; :class:`Fp8Config`'s default choice of layers),
            or ``None``. With fp8, :meth:`apply` goes through :func:`mixprec.prepare` at every level.
        optimizer_state, step_in_backward: :class:`PrepareConfig`'s (what :func:`tune` with a
            ``memory_budget`` chooses to fit); either goes through :func:`mixprec.prepare` at every level.
        layers: the per-layer plan (:func:`tune` with ``per_layer=True``): each GEMM layer
            with what each precision cost there and its choice; a layer whose choice is not ``dtype``
            computes in its own precision (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8-tensorwise"``,
            ``"fp8-rowwise"``), whatever the region around it.
        loss_scale: the GradScaler's initial scale for fp16 (and for layers planned in fp16).
        measurements: every candidate :func:`tune` measured (empty for a hand-made recipe).
        notes: what the search found, in sentences.
        measured_on: the device and torch version the measurements come from.
        tuning_s: seconds the search took.
        timing_noise: how uncertain a candidate's speed against torch.amp's default was (the median over
            the candidates timed of :attr:`Measurement.noise`: half an approximate 95% interval of the
            median step-time ratio, relative, 0.03 is ±3%); a recipe had to beat the default by its own
            noise as well as by ``min_speedup``. ``None`` for a hand-made recipe.
    """

    dtype: torch.dtype = torch.bfloat16
    fp32_ops: tuple[str, ...] = ()
    keep_fp32: tuple[str, ...] = ()
    layout: str = "contiguous"
    level: Level = Level.O1
    compile: bool = False
    fp8: str | None = None
    optimizer_state: StatePrecision = StatePrecision.FP32
    step_in_backward: bool = False
    layers: tuple[LayerChoice, ...] = ()
    loss_scale: float = 2.0**16
    measurements: tuple[Measurement, ...] = ()
    notes: tuple[str, ...] = ()
    measured_on: str = ""
    tuning_s: float = 0.0
    timing_noise: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype, what="recipe dtype"))
        object.__setattr__(self, "fp32_ops", tuple(sorted({op_name(o) for o in self.fp32_ops})))
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))
        object.__setattr__(self, "level", Level.from_name(self.level))
        object.__setattr__(self, "optimizer_state", StatePrecision.from_name(self.optimizer_state))
        object.__setattr__(self, "measurements", tuple(self.measurements))
        object.__setattr__(self, "notes", tuple(self.notes))
        layers = tuple(c if isinstance(c, LayerChoice) else LayerChoice(**c) for c in self.layers)
        layers = tuple(
            c if c.default else dataclasses.replace(c, default=self.layer_default(c.name, c.shape)) for c in layers
        )
        object.__setattr__(self, "layers", layers)
        layer_choice.check_choices(layers)
        if self.fp8 is not None:
            if not isinstance(self.fp8, str):
                raise TypeError(
                    "Recipe.fp8 is a recipe name ('tensorwise', 'rowwise', 'rowwise_with_gw_hp', "
                    "'delayed'), data a JSON file holds; to choose layers or set delayed scaling, pass "
                    "PrepareConfig(fp8=mixprec.Fp8Config(...)) to mixprec.prepare"
                )
            object.__setattr__(self, "fp8", Fp8Recipe.from_name(self.fp8).value)
            if self.dtype is torch.float32:
                raise ValueError("fp8 linears train beside a low-precision recipe; use dtype bf16 (or fp16) with fp8")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; valid: {', '.join(LAYOUTS)}")
        if self.dtype is torch.float32 and (self.level is not Level.O1 or self.fp32_ops or self.keep_fp32):
            raise ValueError("an fp32 recipe has no level, op moves or kept modules; use level 'O1' and none")
        if self.level is not Level.O1 and self.fp32_ops:
            raise ValueError(
                f"level {self.level!r} runs the forward under prepare()'s own autocast region with the built-in "
                "policy, so op moves (fp32_ops) apply with level 'O1' only"
            )
        if self.level.bf16_weights and self.dtype is not torch.bfloat16:
            raise ValueError(f"level {self.level!r} needs dtype bf16")
        if (self.optimizer_state.own or self.step_in_backward) and self.dtype is torch.float32:
            raise ValueError(
                "optimizer_state and step_in_backward go through mixprec.prepare: use a low-precision dtype with them"
            )

    @property
    def name(self) -> str:
        """One line, e.g. ``bf16 O1 +fp32[scaled_dot_product_attention] channels_last``."""
        parts = [short_name(self.dtype)]
        if self.dtype is not torch.float32:
            parts.append(self.level.value)
        if self.fp32_ops:
            parts.append(f"+fp32[{', '.join(self.fp32_ops)}]")
        if self.keep_fp32:
            parts.append(f"keep[{', '.join(self.keep_fp32)}]")
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.fp8 is not None:
            parts.append(f"fp8[{self.fp8}]")
        if self.optimizer_state.own:
            parts.append(f"state[{self.optimizer_state}]")
        if self.step_in_backward:
            parts.append("step-in-backward")
        moved = self.moved_layers
        if moved:
            counts = {p: sum(1 for c in moved if c.choice == p) for p in dict.fromkeys(c.choice for c in moved)}
            parts.append(f"layers[{', '.join(f'{n} {p}' for p, n in counts.items())}]")
        if self.compile:
            parts.append("compile")
        return " ".join(parts)

    @property
    def moved_layers(self) -> tuple[LayerChoice, ...]:
        """The layers the per-layer plan gives another precision than the rest of the recipe would."""
        return tuple(c for c in self.layers if c.moved)

    def layer_default(self, name: str, shape: str = "") -> LayerPrecision:
        """The precision this recipe gives layer ``name`` without a plan: fp32 where it keeps the layer (or a
        module holding it) in fp32 or moves its op (``shape``'s first word: ``linear``, ``conv2d``) to fp32,
        else its dtype."""
        parts = name.split(".")
        holders = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        kept = any(fnmatch.fnmatchcase(h, pattern) for h in holders for pattern in self.keep_fp32)
        op = shape.split(" ", 1)[0]
        return LayerPrecision.FP32 if kept or (op and op in self.fp32_ops) else LayerPrecision.from_name(self.dtype)

    @property
    def is_torch_default(self) -> bool:
        """Whether this is plain ``torch.autocast`` at this dtype: torch's op lists, nothing else."""
        return (
            self.level is Level.O1
            and not self.fp32_ops
            and not self.keep_fp32
            and self.layout == "contiguous"
            and not self.compile
            and self.fp8 is None
            and not self.moved_layers
            and self.dtype is not torch.float32
        )

    def policy(self, device_type: str = "cpu") -> Policy:
        """The autocast policy: ``device_type``'s built-in lists with the op moves and module rules."""
        policy = default_policy(device_type)
        if self.fp32_ops:
            policy = policy.add("fp32", *self.fp32_ops)
        if self.keep_fp32:
            policy = policy.keep_modules(names=self.keep_fp32)
        return policy

    def prepare_config(self, device_type: str = "cpu") -> PrepareConfig:
        """What :meth:`apply` passes to :func:`mixprec.prepare` (at levels other than O1, and with fp8).

        Raises:
            ValueError: an fp32 recipe (nothing to prepare).
        """
        if self.dtype is torch.float32:
            raise ValueError("an fp32 recipe prepares nothing; apply it, or train the model as it is")
        level = self.level
        policy = self.policy(device_type) if level is Level.O1 else None  # O1: prepare's region is the recipe's
        return PrepareConfig(
            level=level,
            dtype=self.dtype,
            keep_names=self.keep_fp32,
            policy=policy,
            fp8=as_fp8_config(self.fp8),
            optimizer_state=self.optimizer_state,
            step_in_backward=self.step_in_backward,
        )

    @property
    def _prepares(self) -> bool:
        # compiled, the region goes inside the model's forward (prepare's): a graph traced inside an eager
        # region with an edited policy could not follow a later change of it, and is refused
        return self.dtype is not torch.float32 and (
            self.level is not Level.O1
            or self.fp8 is not None
            or self.compile
            or self.optimizer_state.own
            or self.step_in_backward
        )

    def autocast(self, device_type: str = "cpu") -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """The region factory for the training loop: a :func:`mixprec.autocast` with :meth:`policy`,
        or a no-op for fp32 and where the model is prepared (its prepared forward opens its own)."""
        if self.dtype is torch.float32 or self._prepares:
            return contextlib.nullcontext
        return _RegionFactory(device_type, self.dtype, self.policy(device_type))

    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Applied:
        """Set ``model`` and ``optimizer`` up for this recipe (in place); returns what the loop needs.

        The policy is rebuilt from the model's device type, so a recipe tuned on one machine applies
        on another (op names are ATen names, module names are the model's).

        Raises:
            ValueError: a model already prepared by :func:`mixprec.prepare`, or a level prepare rejects.
        """
        if prepared_state(model) is not None:
            raise ValueError("this model was already prepared by mixprec.prepare; apply a recipe to an fp32 model")
        device_type = input_checks.device_type_of(model)
        if self.layout == "channels_last":
            to_channels_last(model)
        region = self.autocast(device_type)
        if self._prepares:  # prepare's forward opens its own region
            model, optimizer = prepare(model, optimizer, self.prepare_config(device_type))
        layer_choice.apply(model, self.layers)
        fp16 = self.dtype is torch.float16 or any(c.choice == "fp16" for c in self.layers)
        scaler = GradScaler(device_type, init_scale=self.loss_scale) if fp16 else None
        if self.compile:
            model = torch.compile(model)  # type: ignore[assignment]
        return Applied(model, optimizer, region, scaler, self.layout == "channels_last")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: dtypes by short name, ops by ATen name."""
        out = dataclasses.asdict(self)
        out["dtype"] = short_name(self.dtype)
        out["measurements"] = [dataclasses.asdict(m) for m in self.measurements]
        out["layers"] = [{**dataclasses.asdict(c), "ms": dict(c.ms), "sqnr_db": dict(c.sqnr_db)} for c in self.layers]
        return out

    def to_json(self, path: str | None = None) -> str:
        """The recipe as JSON text; also written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        """Read :meth:`to_json`'s text (or a path to a file holding it).

        Raises:
            ValueError: not a recipe (the message names the unknown or missing fields).
        """
        if not text.lstrip().startswith("{"):
            with open(text) as fh:
                text = fh.read()
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a recipe is a JSON object as written by Recipe.to_json")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown recipe fields {unknown}; valid: {sorted(fields)}")
        data["measurements"] = tuple(Measurement(**m) for m in data.get("measurements", ()))
        data["layers"] = tuple(LayerChoice(**c) for c in data.get("layers", ()))
        for key in ("fp32_ops", "keep_fp32", "notes"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)

    def table(self) -> str:
        """The candidates as a text table: speed against torch.amp's default, error against fp32, why rejected."""
        return tables.recipe_table(self)


class _RegionFactory:
    """A printable factory of the recipe's autocast regions."""

    def __init__(self, device_type: str, dtype: torch.dtype, policy: Policy) -> None:
        self.device_type, self.dtype, self.policy = device_type, dtype, policy

    def __call__(self) -> autocast:
        return autocast(self.device_type, dtype=self.dtype, policy=self.policy)

    def __repr__(self) -> str:
        return f"autocast({self.device_type!r}, dtype={short_name(self.dtype)}, policy={self.policy!r})"


@dataclasses.dataclass
class Applied:
    """What a training loop needs from :meth:`Recipe.apply`.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Linear(4, 2)
        >>> run = mixprec.Recipe(dtype="bf16").apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with run.autocast():
        ...     loss = run.model(run.inputs(torch.randn(8, 4))).float().square().mean()
        >>> run.backward(loss); run.step()

    Attributes:
        model: the model to call (prepared at levels other than O1).
        optimizer: its optimizer.
        autocast: ``() -> context manager``: open one around forward and loss (a no-op where the
            model's forward opens its own, at levels other than O1, and for fp32).
        scaler: a :class:`mixprec.GradScaler` for fp16, else ``None``.
        channels_last: whether :meth:`inputs` converts 4-D/5-D inputs to channels_last.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    scaler: GradScaler | None
    channels_last: bool = False

    def inputs(self, batch: Any) -> Any:
        """``batch`` with its 4-D/5-D floating tensors in the recipe's layout."""
        if not self.channels_last:
            return batch

        def convert(t: Any) -> Any:
            ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() in (4, 5)
            return to_channels_last(t) if ok else t

        return tree_map(convert, batch)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the scaler for fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()  # type: ignore[no-untyped-call]

    def step(self) -> None:
        """The optimizer step (``scaler.step`` and ``scaler.update`` for fp16)."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()


# ----- the search ------------------------------------------------------------------------
