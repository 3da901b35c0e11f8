"""K/V in 8-bit floats: quantize as the pool stores, dequantize as attention reads.

A stored element is `q = fp8(clamp(x / scale, -max, max))` and reads back as
`float(q) * scale`, with `max` the format's largest finite value (448 for
e4m3fn, 57344 for e5m2). Rounding is to nearest even, below the smallest normal
into the subnormals; the clamp makes the conversion saturate, so a finite
input never becomes inf or NaN (e4m3fn has no inf; its only NaN code is not
produced). Scales are one float per layer for K and one for V
(docs/architecture.md, "FP8 KV cache").
"""

from __future__ import annotations

import torch

from worker.kv_bytes import FP8_ELEMENTS

__all__ = ["FP8_DTYPES", "dequantize", "is_fp8", "quantize"]

FP8_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in FP8_ELEMENTS)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV pool of `dtype` holds scaled 8-bit floats."""
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` in the fp8 `dtype`, saturating at its largest finite value."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize(q: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q` (fp8) times `scale`, in `dtype`."""
    return (q.float() * scale).to(dtype)
