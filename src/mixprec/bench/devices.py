"""The bench's devices and dtypes: what ``auto`` means, a rank's device, and waiting for the device."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["rank_device", "resolve_device", "resolve_dtype", "sync"]


def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA if present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available; use --device cpu or auto")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"the bench runs on cpu or cuda, not {resolved.type!r}")
    return resolved


def rank_device(device: str, rank: int) -> torch.device:
    """:func:`resolve_device`, one GPU a rank (round robin) on CUDA."""
    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bf16 where it is fast (CPUs with AVX512-BF16/AMX, GPUs since Ampere), else fp16 on CUDA."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16  # emulated (and slow) on CPUs without bf16 instructions; fp16 is slower still
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; valid: auto, bf16, fp16")
    return names[dtype]


def sync(device: torch.device, world: int = 1) -> None:
    """Wait for ``device``'s queued work (CUDA) and, with ``world > 1``, for every rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world > 1:
        dist.barrier()
