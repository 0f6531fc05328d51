"""The kernels inductor generates for fp8 linears: mixprec's against torchao's ``Float8Linear``.

:func:`count_fp8_kernels` builds one small fp32 model of linears (with ReLUs between them) and
compiles it with ``torch.compile`` (the default inductor backend) three ways:

* ``O1 (no fp8)``: ``mixprec.prepare(model, opt, "O1")``, bf16 GEMMs: what the model costs without fp8;
* ``mixprec``: ``mixprec.prepare(model, opt, "O1", fp8=recipe)``, every linear converted;
* ``torchao``: torchao's ``convert_to_float8_training`` with the same recipe on the same linears, the
  forward under ``torch.autocast`` (O1's bf16), if torchao is installed.

It runs one forward and backward of each and captures the code inductor wrote for every graph
(``torch._inductor.utils.run_and_get_code``: the forward, then the backward). :func:`count_code`
counts in that code the kernels inductor generated (Triton on CUDA, C++ on a CPU), how often the
graph's ``call`` launches them, the calls to external kernels (``extern_kernels.*``: the GEMMs) and
the ATen ops left to eager kernels (fallbacks).
"""

from __future__ import annotations

import re
import time
import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

import mixprec

#: The model's widths: three linears, 256 -> 512 -> 512 -> 256 (multiples of 16, as fp8 GEMMs need).
SIZES = (256, 512, 512, 256)
TOKENS = 256

_DEFINITION = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.MULTILINE)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
# mixprec's CPU fp8 GEMM, an opaque op in the graph: ``_scaled_mm`` as ATen emulates it (``fp8/gemm.py``)
_CPU_SCALED_MM = re.compile(r"\btorch\.ops\.mixprec\.cpu_scaled_mm\.default\(")
_FALLBACK = re.compile(r"\b(?:torch\.ops\.)?(aten|prims|_quantized|quantized)\.(\w+)\.\w+\(")


def count_code(code: str) -> dict[str, Any]:
    """Count what one graph's inductor output code runs.

    Returns ``{"kernels": generated kernels defined, "launches": their calls in the graph's ``call``,
    "extern": {name: calls} of ``extern_kernels`` (GEMMs and other library kernels; mixprec's CPU fp8 GEMM
    counted as the ``_scaled_mm`` it runs), "fallbacks":
    {aten op: calls}, "kernel_names": [...], "launches_by_kernel": {name: calls}}``. Kernels are the
    ``name = async_compile.<kind>(...)`` definitions (``triton``, ``cpp_pybinding``, ...).
    """
    names = [name for name, _ in _DEFINITION.findall(code)]
    start = code.find("def call(")
    body = code[start:] if start >= 0 else ""
    launched = {name: len(re.findall(rf"\b{re.escape(name)}(?:\.run)?\(", body)) for name in names}
    extern = Counter(_EXTERN.findall(body))
    extern["_scaled_mm"] += len(_CPU_SCALED_MM.findall(body))
    extern = +extern  # no zero counts
    fallbacks = Counter(f"{ns}.{op}" for ns, op in _FALLBACK.findall(body))
    return {
        "kernels": len(names),
        "launches": sum(launched.values()),
        "extern": dict(extern),
        "fallbacks": dict(fallbacks),
        "kernel_names": names,
        "launches_by_kernel": launched,
    }


def _model(device: torch.device, sizes: tuple[int, ...]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(device)


def _capture(model: nn.Module, x: torch.Tensor, autocast: bool) -> tuple[list[str], float]:
    """Inductor's code for one compiled forward and backward of ``model``, and the seconds that took."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(model)

    def forward_backward() -> None:
        given = x.detach().clone().requires_grad_()
        if autocast:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                out = compiled(given)
        else:
            out = compiled(given)
        out.float().square().mean().backward()

    torch._dynamo.reset()  # a graph of its own: no cache entry of another variant is reused
    begin = time.perf_counter()
    _, codes = run_and_get_code(forward_backward)
    return list(codes), time.perf_counter() - begin


def _summary(codes: list[str], seconds: float, linears: int) -> dict[str, Any]:
    labels = ["forward", "backward"] if len(codes) == 2 else [f"graph {i + 1}" for i in range(len(codes))]
    graphs = [{"name": label, **count_code(code)} for label, code in zip(labels, codes, strict=True)]
    kernels = sum(g["kernels"] for g in graphs)
    return {
        "graphs": graphs,
        "kernels": kernels,
        "launches": sum(g["launches"] for g in graphs),
        "extern_calls": sum(sum(g["extern"].values()) for g in graphs),
        "fallback_calls": sum(sum(g["fallbacks"].values()) for g in graphs),
        "kernels_per_linear": kernels / linears,
        "launches_per_linear": sum(g["launches"] for g in graphs) / linears,
        "compile_s": seconds,
    }


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def count_fp8_kernels(
    device: str | torch.device = "cpu", recipe: str = "tensorwise", sizes: tuple[int, ...] = SIZES, tokens: int = TOKENS
) -> dict[str, Any]:
    """Kernels inductor generates per fp8 linear, forward and backward: mixprec against torchao (see the module).

    Returns ``{"device", "recipe", "sizes", "tokens", "linears", "variants": {name: summary or
    {"error": why}}, "mixprec_higher": [where mixprec's count exceeds torchao's, one line each]}``;
    a summary holds per graph the counts of :func:`count_code`, the totals, ``kernels_per_linear`` and
    ``launches_per_linear`` (forward and backward together, over the fp8 linears) and ``compile_s``.
    """
    device = torch.device(device)
    x = torch.randn(tokens, sizes[0], device=device)
    variants: dict[str, dict[str, Any]] = {}
    linears = len(sizes) - 1
    converted: list[str] = []
    for name in ("O1 (no fp8)", "mixprec"):
        model: nn.Module = _model(device, sizes)
        optimizer = torch.optim.AdamW(model.parameters())
        try:
            fp8 = mixprec.Fp8Config(mixprec.Fp8Recipe(recipe), convert_head=True) if name == "mixprec" else None
            model, _ = mixprec.prepare(model, optimizer, "O1", dtype=torch.bfloat16, fp8=fp8)
            if fp8 is not None and (layers := mixprec.fp8_layers(model)) is not None:
                converted = list(layers.converted)
                linears = len(converted) or linears
            variants[name] = _summary(*_capture(model, x, autocast=False), linears)
        except Exception as exc:  # a GPU without fp8 GEMMs, a compile failure: reported, the rest goes on
            variants[name] = {"error": _error(exc)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchao's import warns about its optional extensions
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        theirs = _model(device, sizes)
        chosen = set(converted) if converted else None
        convert_to_float8_training(
            theirs,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, fqn: chosen is None or fqn in chosen,
        )
        variants["torchao"] = _summary(*_capture(theirs, x, autocast=True), linears)
    except ImportError as exc:
        variants["torchao"] = {"error": f"torchao is not installed ({exc.name}): pip install torchao"}
    except Exception as exc:
        variants["torchao"] = {"error": _error(exc)}
    torch._dynamo.reset()
    return {
        "device": device.type,
        "recipe": recipe,
        "sizes": list(sizes),
        "tokens": tokens,
        "linears": linears,
        "variants": variants,
        "mixprec_higher": mixprec_higher(variants),
    }


def mixprec_higher(variants: dict[str, dict[str, Any]]) -> list[str]:
    """Where mixprec's fp8 graphs hold more than torchao's: per graph, generated kernels, their launches, extern
    calls and fallbacks; one line each, naming the kernels of that graph on both sides. Empty if nowhere (or if
    either side could not be counted)."""
    ours, theirs = variants.get("mixprec", {}), variants.get("torchao", {})
    if "graphs" not in ours or "graphs" not in theirs:
        return []
    lines = []
    if len(ours["graphs"]) > len(theirs["graphs"]):
        lines.append(f"graphs: {len(ours['graphs'])} against torchao's {len(theirs['graphs'])}")
    for mine, peer in zip(ours["graphs"], theirs["graphs"], strict=False):
        for key, what in (("kernels", "generated kernels"), ("launches", "kernel launches")):
            if mine[key] > peer[key]:
                lines.append(
                    f"{mine['name']}: {mine[key]} {what} against torchao's {peer[key]} (mixprec: "
                    f"{_launched(mine)}; torchao: {_launched(peer)})"
                )
        for key, what in (("extern", "extern kernel calls"), ("fallbacks", "ATen fallback calls")):
            if sum(mine[key].values()) > sum(peer[key].values()):
                lines.append(
                    f"{mine['name']}: {sum(mine[key].values())} {what} against torchao's "
                    f"{sum(peer[key].values())} (mixprec: {mine[key]}; torchao: {peer[key]})"
                )
    return lines


def _launched(graph: dict[str, Any]) -> str:
    return ", ".join(f"{name} x{n}" if n != 1 else name for name, n in graph["launches_by_kernel"].items())
