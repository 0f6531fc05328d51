"""Memory layout helpers: channels_last for convolution models and their inputs.

On CPUs with AVX512-BF16/AMX, and on GPUs' tensor cores, low-precision
convolutions are fastest in NHWC (channels_last); in NCHW a bf16 1x1 convolution
can be no faster than fp32. MegEngine's AMP converts convolution models to NHWC
for the same reason.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

__all__ = ["T", "to_channels_last"]

T = TypeVar("T", nn.Module, torch.Tensor)


def to_channels_last(obj: T) -> T:
    """Put a module's 4-D/5-D parameters and buffers, or a 4-D/5-D tensor, in channels_last.

    Modules are converted in place and returned; tensors are returned converted
    (4-D: ``torch.channels_last``, 5-D: ``torch.channels_last_3d``). Values are unchanged.

    Raises:
        ValueError: a tensor that is not 4-D or 5-D.
        TypeError: neither a module nor a tensor.

    Example:
        >>> import torch, mixprec
        >>> x = mixprec.to_channels_last(torch.randn(2, 3, 8, 8))
        >>> x.is_contiguous(memory_format=torch.channels_last)
        True
    """
    if isinstance(obj, nn.Module):
        for tensor in (*obj.parameters(), *obj.buffers()):
            if tensor.dim() in (4, 5):
                fmt = torch.channels_last if tensor.dim() == 4 else torch.channels_last_3d
                tensor.data = tensor.data.contiguous(memory_format=fmt)
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 4:
            return obj.contiguous(memory_format=torch.channels_last)
        if obj.dim() == 5:
            return obj.contiguous(memory_format=torch.channels_last_3d)
        raise ValueError(f"channels_last needs a 4-D (NCHW) or 5-D (NCDHW) tensor, got {obj.dim()}-D")
    raise TypeError(f"to_channels_last takes an nn.Module or a tensor, got {type(obj).__name__}")
