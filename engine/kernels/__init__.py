"""Triton kernels for the GPU path: one kernel per module, each with a wrapper that checks its arguments.

The wrappers are the only entry points: they validate shapes, dtypes, devices and strides (ValueError naming the
argument), pick launch parameters from shapes alone (so a CUDA graph capture stays valid), and launch. Without a
GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1), which is how CPU CI tests them.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter. Its tl.dot on bf16 operands is wrong (Triton 3.6-3.9),
    so kernels take a DOT_F32 constexpr from this and upcast dot operands there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None,
          device: torch.device | None = None, inner_contiguous: bool = False) -> None:
    """Raise ValueError naming `name` unless `t` has `ndim` dims, one of `dtypes`, lives on `device`, and (if
    asked) a unit stride in its last dimension."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if inner_contiguous and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
