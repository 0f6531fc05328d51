"""torch's for-loop Adam(W) and SGD steps on the CPU, a whole list in one call, bit for bit: :func:`step_list`,
:func:`sgd_step`.

torch.optim.Adam and AdamW step each weight of a param group with several ATen ops on the CPU (their for-loop, the
CPU default; their foreach form runs the same ops a tensor at a time there). This kernel
(``optim/kernels/adam_aten_lists.cpp``, built as ``cpu_lists``' are) computes each of those ops as ATen does, in the
same order and roundings, on the chunks of a table of the tensors' addresses: one C++ call a param group, dtype
and step count. On fp32 tensors ATen's square root is MKL's ``vmsSqrt`` (about one root in six differs from the
correctly rounded one in the last place), which the kernel calls too, from torch's own library; on bf16 tensors
every op's result is rounded to bf16, the scalars as ATen applies them (eps added as a bf16 value; the foreach
form's decay and beta2 multiplied as bf16 values). Whether it matches torch on this machine is checked once per
process and dtype (:func:`available`: a probe of a few steps against torch); where it does not, or does not
build, torch's own step runs. SGD's for-loop on fp32 weights is ``cpu_lists``' SGD kernel on fp32 storage (its
arithmetic is the for-loop's already: :func:`sgd_step`, probed the same way). SGD on bf16 weights
(``optim/kernels/sgd_aten_bf16.cpp``, :func:`sgd_bf16_step`) follows ATen's bf16 add with alpha where it falls: one
rounding in its vector loop, two in the tail of each thread's share of a tensor (the shares at::parallel_for makes
for the threads torch runs now, the tail the share's length past a whole number of ATen's bf16 vectors), probed
the same way. Nothing here syncs: CPU tensors only.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from mixprec._src.optim import cpu_adam, cpu_lists

__all__ = [
    "GRADS",
    "adam_values",
    "available",
    "expected",
    "scalars",
    "sgd_available",
    "sgd_bf16_available",
    "sgd_bf16_expected",
    "sgd_bf16_step",
    "sgd_expected",
    "sgd_step",
    "step_list",
    "step_table",
    "supports",
    "table",
    "takes",
]

#: values a chunk of the list kernels (their CHUNK): the probe's largest tensor spans two
CHUNK_VALUES = 4096
_SOURCE = cpu_lists._PRELUDE + cpu_adam.kernel_source("adam_aten_lists.cpp")
#: the kernel's flags
DECOUPLED, L2, MAXIMIZE = 1, 2, 4
#: the storage dtypes the Adam(W) kernel steps, and their C++ types
_STORAGE = {torch.float32: "float", torch.bfloat16: "BF16"}


@functools.cache
def _compiled(dtype: torch.dtype) -> Any:
    return cpu_lists._load(
        ["const int64_t*", "int64_t", "const float*", "int64_t", "int64_t"],
        _SOURCE % {"helpers": cpu_adam._HELPERS, "storage": _STORAGE[dtype]},
    )


@functools.cache
def _aten_root() -> int | None:
    """The address of the square root ATen's CPU ``sqrt`` calls for fp32 tensors, MKL's ``vmsSqrt`` (about one
    value in six is a last place from the correctly rounded root), from torch's own library; ``None`` where torch
    was built without it."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        root = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).vmsSqrt
    except (OSError, AttributeError):
        return None
    return ctypes.cast(root, ctypes.c_void_p).value


def expected(dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch's Adam(W) of ``dtype`` CPU weights is expected to take :func:`step_list` (it has not failed to
    build or match in this process); compiles nothing."""
    return dtype in _STORAGE and ("aten-adam", dtype) not in cpu_lists._failed


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`step_list` steps ``dtype`` weights (fp32, bf16) as torch's for-loop Adam(W) does here: its
    kernel builds, ATen's root is found, and a probe of a few steps of tensors of several sizes (vector loops and
    tails, the decays it takes, maximize, a beta1 past 0.5) comes out bitwise equal to torch's for-loop step. Once
    per process and dtype."""
    return dtype in _STORAGE and _probed(("aten-adam", dtype), _probe, dtype)


def supports(group: dict[str, Any], dtype: torch.dtype, decoupled: bool) -> bool:
    """Whether the kernel has ``group``'s arithmetic for ``dtype`` weights: all but Adam's L2 decay of bf16 ones
    (its gradient plus decay rounds where the kernel does not follow it)."""
    return dtype is torch.float32 or decoupled or not float(group["weight_decay"])


_done: set[tuple[Any, ...]] = set()  # the kernels whose probe matched torch in this process (cpu_lists._failed: not)


def _probed(key: tuple[Any, ...], probe: Any, *args: Any) -> bool:
    """Whether ``probe(*args)`` built its kernel and matched torch (once per process and ``key``; it runs with the
    thread's dispatch modes set aside: a mode around the first step sees the step, not the probe)."""
    if key in _done:
        return True
    if key in cpu_lists._failed:
        return False
    with _disable_current_modes():
        matched = cpu_lists._builds(key, probe, *args)
    if matched:
        _done.add(key)
    return matched


def _probe(dtype: torch.dtype) -> None:
    if _aten_root() is None:
        raise RuntimeError("ATen's square root was not found")
    _compiled(dtype)
    g = torch.Generator().manual_seed(0)
    sizes = (1, 7, 16, 33, 47, CHUNK_VALUES + 5)
    cases: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
        (torch.optim.AdamW, {"weight_decay": 0.1, "lr": 0.3}),
        (torch.optim.AdamW, {"weight_decay": 0.1, "lr": 0.3, "foreach": True, "betas": (0.9, 0.95)}),
        (torch.optim.Adam, {"maximize": True, "betas": (0.3, 0.99)}),
    ]
    if dtype is torch.float32:
        cases.append((torch.optim.Adam, {"weight_decay": 0.01, "maximize": True}))
    for kind, options in cases:
        weights = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        grads = [[(torch.randn(n, generator=g) * 1e-2).to(dtype) for n in sizes] for _ in range(3)]
        mine, theirs = [w.clone() for w in weights], [w.clone() for w in weights]
        options = {"lr": 1e-2, "foreach": False, **options}
        ours, torchs = kind(mine, **options), kind(theirs, **options)
        for step, grad in enumerate(grads, 1):
            for w, gw in zip(theirs, grad, strict=True):
                w.grad = gw.clone()
            torchs.step()
            group = ours.param_groups[0]
            states = [ours.state[w] for w in mine]
            for w, gw, st in zip(mine, grad, states, strict=True):
                w.grad = gw.clone()
                if not st:
                    st.update(exp_avg=torch.zeros_like(w), exp_avg_sq=torch.zeros_like(w), step=torch.tensor(0.0))
                st["step"] += 1
            rows = [(w, w.grad, st["exp_avg"], st["exp_avg_sq"]) for w, st in zip(mine, states, strict=True)]
            step_list(rows, group, float(step), isinstance(ours, torch.optim.AdamW))  # type: ignore[arg-type]
        for a, b in zip(mine, theirs, strict=True):
            if not torch.equal(a, b) or not torch.equal(ours.state[a]["exp_avg_sq"], torchs.state[b]["exp_avg_sq"]):
                raise RuntimeError(f"the {dtype} Adam(W) kernel does not step as torch's for-loop here")


def adam_values(group: dict[str, Any], step: float, decoupled: bool, root: Any = None) -> tuple[list[float], int]:
    """The Adam(W) kernels' scalars (as Python floats) and flags for ``group`` at ``step``: AdamW's decay (1 - lr *
    weight decay) or Adam's weight decay, 1 - beta1, beta2, 1 - beta2, the root of the second bias correction
    (``root`` of it: the for-loop's ``** 0.5`` where ``None``), eps, -lr / the first bias correction."""
    lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
    decay = (1 - lr * weight_decay) if decoupled else weight_decay
    flags = (DECOUPLED if decoupled else L2) * (weight_decay != 0) | MAXIMIZE * bool(group.get("maximize"))
    corrected = bias_correction2**0.5 if root is None else root(bias_correction2)
    return [decay, 1 - beta1, beta2, 1 - beta2, corrected, eps, -(lr / bias_correction1)], flags


def scalars(group: dict[str, Any], step: float, decoupled: bool, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The Adam(W) kernel's scalars and flags for ``group`` at ``step``, made as torch's for-loop makes them: in
    Python floats (doubles), each narrowed to fp32 where ATen applies it to a tensor; on bf16 tensors, eps to bf16
    (``add_`` adds it as one), and in the foreach form (``group["foreach"]``) the decay and beta2 too (its
    ``_foreach_mul_`` multiplies by a bf16 scalar)."""
    values, flags = adam_values(group, step, decoupled)
    if dtype is torch.bfloat16:
        values[5] = _bf16(values[5])
        if group.get("foreach"):
            values[0] = _bf16(values[0]) if decoupled else values[0]
            values[2] = _bf16(values[2])
    return torch.tensor(values, dtype=torch.float32), flags


def _bf16(value: float) -> float:
    """``value`` as ATen applies a scalar to a bf16 tensor: rounded to fp32, then to bf16 (to nearest even), on the
    host."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]  # type: ignore[no-any-return]


def takes(*tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a weight's tensors (weight, gradient, state) go in a kernel's list: contiguous dense ``dtype`` CPU
    tensors of one size, none a subclass."""
    n = tensors[0].numel()
    for t in tensors:  # a loop, not all() over a generator: this runs for every weight at every step
        if t.dtype is not dtype or not t.is_cpu or t.layout is not torch.strided or t.numel() != n:
            return False
        if not t.is_contiguous() or (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter):
            return False
    return True


def table(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> cpu_lists.Table:
    """The kernel's table of ``rows`` (weight, gradient, exp_avg, exp_avg_sq): their addresses and sizes, a row each
    (the gradients' in column ``GRADS``)."""
    return cpu_lists.Table([[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel()] for p, g, m, v in rows])


#: the column of a table that holds the gradients' addresses
GRADS = 1


def step_table(table: cpu_lists.Table, dtype: torch.dtype, group: dict[str, Any], step: float, decoupled: bool) -> None:
    """:func:`step_list` of the rows a :func:`table` holds (``dtype`` tensors)."""
    values, flags = scalars(group, step, decoupled, dtype)
    _compiled(dtype)(table.tensor, table.rows, values, flags, _aten_root())


def step_list(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    group: dict[str, Any],
    step: float,
    decoupled: bool,
) -> None:
    """torch.optim.Adam(W)'s for-loop step of every ``(weight, gradient, exp_avg, exp_avg_sq)`` of ``rows`` (CPU
    tensors of one dtype, :func:`takes`) at step count ``step`` (already counted) with ``group``'s options, in one
    call, bit for bit (``decoupled``: AdamW's decay). Call where :func:`available` and :func:`supports`."""
    step_table(table(rows), rows[0][0].dtype, group, step, decoupled)


def sgd_available() -> bool:
    """Whether :func:`sgd_step` steps as torch's for-loop SGD does here: its kernel builds and a probe of a few steps
    (weight decay, momentum with dampening, nesterov, maximize; tensors with vector tails) matches torch's for-loop
    bitwise. Once per process."""
    return _probed(("fp32-sgd",), _probe_sgd)


def sgd_expected() -> bool:
    """Whether torch's SGD of fp32 CPU weights is expected to take :func:`sgd_step`; compiles nothing."""
    return ("fp32-sgd",) not in cpu_lists._failed


def _probe_sgd() -> None:
    cpu_lists._sgd("float")
    _probe_sgd_of(torch.float32, (False,), (1, 7, 33, CHUNK_VALUES + 5), lambda rows, group, _: sgd_step(rows, group))


#: the SGD probes' options: momentum with dampening and decay, nesterov with maximize, plain decay
_SGD_CASES: tuple[dict[str, Any], ...] = (
    {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    {"momentum": 0.8, "nesterov": True, "maximize": True},
    {"weight_decay": 0.1},
)


def _probe_sgd_of(dtype: torch.dtype, forms: tuple[bool, ...], sizes: tuple[int, ...], step: Any) -> None:
    """Three steps of ``step(rows, group, every buffer started)`` against torch's SGD (its for-loop, and its foreach
    form where ``forms`` has ``True``) on ``dtype`` weights of ``sizes``, for each of :data:`_SGD_CASES`; raises where
    the weights differ."""
    g = torch.Generator().manual_seed(0)
    for foreach in forms:
        for options in _SGD_CASES:
            weights = [torch.randn(n, generator=g).to(dtype) for n in sizes]
            mine, theirs = [w.clone() for w in weights], [w.clone() for w in weights]
            torchs = torch.optim.SGD(theirs, lr=0.1, foreach=foreach, **options)  # type: ignore[arg-type]
            group = torch.optim.SGD(mine, lr=0.1, foreach=foreach, **options).param_groups[0]  # type: ignore[arg-type]
            buffers: list[torch.Tensor | None] = [None] * len(mine)
            for _ in range(3):
                grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
                for w, gw in zip(theirs, grads, strict=True):
                    w.grad = gw.clone()
                torchs.step()
                started = all(b is not None for b in buffers)
                rows = []
                for i, (w, gw) in enumerate(zip(mine, grads, strict=True)):
                    began = buffers[i] is not None
                    if group["momentum"] != 0 and buffers[i] is None:
                        buffers[i] = torch.empty_like(w)
                    rows.append((w, gw, buffers[i], began))
                step(rows, group, started)
            if not all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)):
                raise RuntimeError(f"the {dtype} SGD kernel does not step as torch's SGD here")


def sgd_step(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]],
    group: dict[str, Any],
    copies: list[torch.Tensor | None] | None = None,
) -> None:
    """torch.optim.SGD's for-loop step of every ``(weight, gradient, momentum buffer or None, buffer started)`` of
    ``rows`` (fp32 CPU tensors, :func:`takes`) with ``group``'s options, in one call, bit for bit; a buffer not
    started yet is written as torch makes it (the gradient, with decay). ``copies``: a bf16 copy of each row's weight
    or ``None`` (contiguous, of its size: O2's compute copies), written with it (to nearest even, as ``copy_``). Call
    where :func:`sgd_available`."""
    mode = cpu_lists.NEAREST if copies is None else cpu_adam.COPIED
    held = [None] * len(rows) if copies is None else copies
    cpu_lists.sgd_step([(p, g, b, c, 0, s) for (p, g, b, s), c in zip(rows, held, strict=True)], group, mode, "float")


_SGD_BF16_SOURCE = cpu_lists._PRELUDE + cpu_adam.kernel_source("sgd_aten_bf16.cpp")
#: bf16 values a vector of ATen's CPU kernels holds, by the capability torch dispatches to
_BF16_WIDTHS = {"AVX512": 32, "AVX2": 16}


@functools.cache
def _sgd_bf16() -> Any:
    argtypes = ["const int64_t*", "int64_t", "const float*", "int64_t", "int64_t", "int64_t"]
    return cpu_lists._load(argtypes, _SGD_BF16_SOURCE % {"helpers": cpu_adam._HELPERS})


def sgd_bf16_available() -> bool:
    """Whether :func:`sgd_bf16_step` steps bf16 weights as torch's for-loop and foreach SGD do here: ATen's vector
    width is known, the kernel builds and a probe of a few steps (tensors split across threads, with tails of their
    shares; decay, momentum with dampening, nesterov, maximize; both forms) matches torch bitwise. Once per
    process."""
    return torch.backends.cpu.get_cpu_capability() in _BF16_WIDTHS and _probed(("bf16-sgd",), _probe_sgd_bf16)


def sgd_bf16_expected() -> bool:
    """Whether torch's SGD of bf16 CPU weights is expected to take :func:`sgd_bf16_step`; compiles nothing."""
    return torch.backends.cpu.get_cpu_capability() in _BF16_WIDTHS and ("bf16-sgd",) not in cpu_lists._failed


def sgd_bf16_step(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]], group: dict[str, Any],
                  all_started: bool) -> None:  # fmt: skip
    """torch.optim.SGD's step of every ``(weight, gradient, momentum buffer or None, buffer started)`` of ``rows``
    (bf16 CPU tensors, :func:`takes`) with ``group``'s options, in one call, bit for bit its for-loop or foreach
    form (``group["foreach"]``); ``all_started``: every bf16 buffer of the group's list was started before this step
    (the foreach form multiplies them by a bf16 momentum then, else each by an fp32 one). A buffer not started is
    written as torch makes it (the gradient, with decay). Call where :func:`sgd_bf16_available`."""
    momentum = float(group["momentum"])
    flags = cpu_lists.NESTEROV * bool(group.get("nesterov")) | cpu_lists.MAXIMIZE * bool(group.get("maximize"))
    flags |= cpu_lists.MOMENTUM * (momentum != 0)
    applied = _bf16(momentum) if group.get("foreach") and all_started else momentum
    values = [_bf16(float(group["weight_decay"])), applied, _bf16(1.0 - float(group["dampening"]))]
    values += [_bf16(-float(group["lr"])), _bf16(momentum)]
    table = cpu_lists._table([[p.data_ptr(), g.data_ptr(), 0 if b is None else b.data_ptr(), p.numel(), int(started)]
                              for p, g, b, started in rows])  # fmt: skip
    width = _BF16_WIDTHS[torch.backends.cpu.get_cpu_capability()]
    _sgd_bf16()(table, len(rows), torch.tensor(values, dtype=torch.float32), flags, torch.get_num_threads(), width)


def _probe_sgd_bf16() -> None:
    _sgd_bf16()
    _probe_sgd_of(torch.bfloat16, (False, True), (1, 33, 95, 1000, CHUNK_VALUES + 37, 2 * 32768 + 41), sgd_bf16_step)
