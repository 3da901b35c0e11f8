"""Paged attention: metadata for a mixed prefill/decode batch, and the backends.

Every backend has one signature::

    backend(q [T, Hq, D], k_cache, v_cache, meta: AttentionMetadata, scale,
            k_scale=1.0, v_scale=1.0) -> [T, Hq, D]

where the caches are one layer's `[num_blocks, block_size, Hkv, D]` tensors
(`KVPool.k_cache(layer)`) that ALREADY hold this step's new K/V (the model
writes through `meta.slot_mapping` first). Each query attends causally to every
token of its own sequence up to and including its own position. An fp8 cache
(worker/kv_quant.py) is read as `float(element) * k_scale` (`v_scale` for V),
the layer's scales (`KVPool.k_scale(layer)`); every backend reads one.

Backends: "reference" (per-sequence, float32, the ground truth), "torch"
(vectorised gather decode + per-sequence SDPA prefill), "numba" (a compiled
block-wise decode kernel that reads blocks in place, float32 decodes; other
dtypes and prefills take the torch path; the CPU default) and "triton"
(Triton paged-decode kernel for decodes, the torch prefill path otherwise; the
CUDA default). Numba and Triton are imported only when their backend is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from worker.attention.metadata import AttentionMetadata, SeqSpec
from worker.attention.reference import reference_attention
from worker.attention.torch_paged import PagedAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKEND_NAMES",
    "SeqSpec",
    "check_kv_dtype",
    "get_backend",
    "select_backend",
]

AttentionBackend = Callable[..., torch.Tensor]  # the signature above

BACKEND_NAMES = ("reference", "torch", "numba", "triton")

log = logging.getLogger(__name__)


def get_backend(name: str) -> AttentionBackend:
    """A new instance of the backend called `name` (one of BACKEND_NAMES).

    Backends may keep per-step state (plans, buffers): use one per model.
    """
    if name == "reference":
        return reference_attention
    if name == "torch":
        return PagedAttention()
    if name == "numba":
        from worker.attention.cpu_decode import DTYPES, compile_kernels, numba_decode

        return PagedAttention(
            decode_fn=numba_decode, decode_dtypes=DTYPES, compile_fn=compile_kernels
        )
    if name == "triton":
        from worker.attention.triton_decode import triton_decode

        return PagedAttention(decode_fn=triton_decode)
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")


def check_kv_dtype(
    backend: AttentionBackend,
    kv_dtype: torch.dtype,
    device: str | torch.device,
    capability: tuple[int, int] | None = None,
) -> None:
    """ValueError (one line) if `backend` cannot read a `kv_dtype` cache on `device`.
    Every backend reads both fp8 formats, except the Triton kernel on a GPU
    before compute capability 8.9, which has no e4m3 conversion (e5m2 has one
    everywhere). `capability`: the GPU's (default: asked from torch)."""
    if kv_dtype != torch.float8_e4m3fn or getattr(backend, "decode_fn", None) is None:
        return
    if backend.decode_fn.__name__ != "triton_decode" or torch.device(device).type != "cuda":  # type: ignore[attr-defined]
        return
    capability = capability or torch.cuda.get_device_capability(device)
    if tuple(capability) < (8, 9):
        raise ValueError(
            "--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer for the "
            f"Triton attention kernel; this one is {capability[0]}.{capability[1]}: use fp8_e5m2"
        )


def select_backend(device: str | torch.device) -> AttentionBackend:
    """Triton on CUDA (torch if triton is not installed), the Numba kernel elsewhere."""
    if torch.device(device).type == "cuda":
        try:
            return get_backend("triton")
        except ImportError:
            log.warning("triton is not installed: CUDA attention falls back to the torch path")
    return get_backend("numba")
