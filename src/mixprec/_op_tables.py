"""torch's own autocast op lists, by ATen name, and their Python entry points.

torch.autocast works at the dispatcher: it sees ATen ops. mixprec works over
``TorchFunctionMode``: it sees the Python-visible callables (``torch.mm``,
``torch.Tensor.mm``, ``torch._C._nn.linear`` ...). This module keeps torch's
lists as ATen names and resolves each name to every builtin that a
``__torch_function__`` handler can receive for it.

Python wrappers (``torch.nn.functional.mse_loss``, ``torch.stft``) are not
listed: the mode redispatches into them and sees the builtin they call, so the
cast happens at the same op where torch casts.

A few builtins are C++ composites whose inner ATen op is on a list although
the composite is not (``einsum`` reaches ``bmm``, ``concat`` reaches ``cat``,
``nll_loss_nd`` reaches ``nll_loss``). The inner op is invisible to a
TorchFunctionMode, so the composite itself is listed (``*_COMPOSITES``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# aten/src/ATen/autocast_mode.cpp, AutocastCPU.
CPU_LOWER = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
    "_addmm_activation", "addbmm", "linear", "_convolution", "matmul", "conv_tbc",
    "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
)  # fmt: skip
CPU_FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile",
    "nanquantile", "stft", "cdist", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d", "trace", "view_as_complex", "cholesky", "cholesky_inverse",
    "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "ctc_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
    "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft",
    "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft",
    "fft_ihfft", "linalg_cond", "linalg_matrix_rank", "linalg_solve", "linalg_cholesky",
    "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd",
    "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
    "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr",
    "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
    "linalg_inv_ex",
)  # fmt: skip
CPU_PROMOTE = ("stack", "cat", "index_copy")

# Builtins whose C++ body reaches an op of the CPU lists above.
CPU_LOWER_COMPOSITES = (
    "einsum", "chain_matmul", "linalg_multi_dot", "tensordot", "cov", "corrcoef", "matrix_power",
    "linalg_matrix_power",
)  # fmt: skip
CPU_FP32_COMPOSITES = ("nll_loss_nd", "pad")
PROMOTE_COMPOSITES = ("concat", "concatenate", "hstack", "vstack", "dstack", "column_stack", "row_stack")

# aten/src/ATen/autocast_mode.h, AT_FORALL_* (AutocastCUDA, also XPU).
CUDA_LOWER = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum",
    "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)  # fmt: skip
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
)  # fmt: skip
CUDA_FP32_COMPOSITES = ("nll_loss_nd", "cross_entropy_loss")
# fp32_set_opt_dtype and fp32_append_dtype: run in fp32 by setting the op's dtype argument.
CUDA_FP32_SET_DTYPE = (
    "prod", "softmax", "log_softmax", "_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm",
)  # fmt: skip
CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)  # fmt: skip
CUDA_BANNED = {
    "binary_cross_entropy": (
        "binary_cross_entropy (torch.nn.functional.binary_cross_entropy, torch.nn.BCELoss) "
        "is unsafe to autocast: fp16 sigmoid outputs saturate. Combine the sigmoid and the "
        "loss with torch.nn.functional.binary_cross_entropy_with_logits or "
        "torch.nn.BCEWithLogitsLoss, which are safe to autocast."
    )
}


# Python wrappers and the builtins they can reach, as ATen names. A wrapper whose
# builtins are all unlisted in a policy is called as is (no redispatch); one that
# only checks and reshapes before a single listed builtin takes that builtin's
# category at the wrapper. Both give the numbers of the redispatch path, faster;
# the OpInfo differential test checks it. Unlisted wrappers are redispatched.
WRAPPERS: dict[str, tuple[str, ...]] = {
    "torch.nn.functional.relu": ("relu", "relu_"),
    "torch.nn.functional.relu6": ("hardtanh", "hardtanh_"),
    "torch.nn.functional.silu": ("silu", "silu_"),
    "torch.nn.functional.mish": ("mish", "mish_"),
    "torch.nn.functional.dropout": ("dropout", "dropout_"),
    "torch.nn.functional.embedding": ("embedding", "embedding_renorm_"),
    "torch.nn.functional.layer_norm": ("layer_norm",),
    "torch.nn.functional.group_norm": ("group_norm",),
    "torch.nn.functional.softmax": ("softmax",),
    "torch.nn.functional.log_softmax": ("log_softmax",),
    "torch.nn.functional.cross_entropy": ("cross_entropy_loss",),
    "torch.nn.functional.nll_loss": ("nll_loss_nd",),
    "torch.nn.functional.mse_loss": ("broadcast_tensors", "mse_loss"),
    "torch.nn.functional.l1_loss": ("broadcast_tensors", "l1_loss"),
    "torch.nn.functional.binary_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
    "torch.nn.functional.kl_div": ("kl_div",),
    "torch.functional.broadcast_tensors": ("broadcast_tensors",),
    "torch.functional.einsum": ("einsum",),
    "torch.Tensor.__rsub__": ("rsub",),
    "torch.Tensor.backward": (),
}


def _pad_reaches_fp32_op(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # F.pad reaches reflection_pad1d/2d and replication_pad1d/2d/3d, all on the CPU fp32 list.
    pad = args[1] if len(args) > 1 else kwargs.get("pad", ())
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    dims = len(pad) // 2
    return (mode == "reflect" and dims in (1, 2)) or (mode == "replicate" and dims in (1, 2, 3))


def _matrix_power_multiplies(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # n in (0, 1, -1) returns identity, a copy or an inverse: no matmul is reached.
    n = args[1] if len(args) > 1 else kwargs.get("n", 2)
    return n not in (0, 1, -1)


#: Composites whose inner path depends on their arguments: the category applies only
#: when the predicate says the listed inner op is reached.
CONDITIONS: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {
    "pad": _pad_reaches_fp32_op,
    "matrix_power": _matrix_power_multiplies,
    "linalg_matrix_power": _matrix_power_multiplies,
}


_NAMESPACES: tuple[Any, ...] = (
    *(getattr(torch._C, name) for name in ("_VariableFunctions", "_nn", "_linalg", "_fft", "_special")),
    torch.Tensor,
)


def entry_points(aten_name: str) -> list[Callable[..., Any]]:
    """Every builtin a ``__torch_function__`` handler can receive for ``aten_name``.

    In-place (``mm_``) and ``out=`` variants are separate callables or calls and
    are not returned: torch.autocast does not cast them either.
    """
    found: list[Callable[..., Any]] = []
    for namespace in _NAMESPACES:
        func = getattr(namespace, aten_name, None)
        if func is not None and callable(func) and func not in found:
            found.append(func)
    if aten_name == "matmul":
        found += [torch.Tensor.__matmul__, torch.Tensor.__rmatmul__]
    if aten_name == "pow":
        found += [torch.Tensor.__pow__, torch.Tensor.__rpow__]
    return found


def resolve(names: Iterable[str]) -> frozenset[Callable[..., Any]]:
    """The union of :func:`entry_points` over ``names``; names absent in this torch are skipped."""
    return frozenset(func for name in names for func in entry_points(name))


def wrappers() -> dict[Callable[..., Any], frozenset[Callable[..., Any]]]:
    """wrapper function -> the builtins it can reach, for :data:`WRAPPERS`."""
    found = {}
    for path, names in WRAPPERS.items():
        module_path, _, attr = path.rpartition(".")
        owner: Any = torch
        for part in module_path.split(".")[1:]:
            owner = getattr(owner, part, None)
        func = getattr(owner, attr, None)
        if func is not None:
            found[func] = resolve(names)
    return found


def conditions() -> dict[Callable[..., Any], Callable[[tuple[Any, ...], dict[str, Any]], bool]]:
    """func -> predicate for the ops of :data:`CONDITIONS`."""
    return {func: pred for name, pred in CONDITIONS.items() for func in entry_points(name)}
