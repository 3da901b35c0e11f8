"""The KV layout: what two workers must share for one's K/V bytes to be the other's.

A block's payload (a host-tier slot, a store entry) is its K and V for every
layer, in native byte order (little-endian wherever torch serves):

    [2 (K, V), num_layers, block_size, num_kv_heads, head_dim] of `dtype`

The layout key is a digest of everything that fixes those bytes' meaning: the
model fingerprint (weights and config), block size, element type, KV heads,
head dim, layers, byte order and the payload order; for fp8 also every layer's
K and V scale. Workers with equal keys load each other's blocks; the allocator
keeps store entries per key (docs/architecture.md, "FP8 KV cache").
"""

from __future__ import annotations

import hashlib
import struct
import sys
from dataclasses import dataclass, field

import torch

from worker.kv_bytes import FP8_ELEMENTS, canonical_dtype, kv_bytes_per_token
from worker.kv_pool import KVPool

__all__ = ["LAYOUT_SCHEME", "KVLayout"]

LAYOUT_SCHEME = b"pagedkv/kv-layout/v1"
# Written into the digest: a change of payload order is a change of layout.
_PAYLOAD_ORDER = b"kv,layer,token,head,dim"
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape and meaning of one KV block's bytes; `key` is its digest (64 hex digits)."""

    model_fingerprint: str
    block_size: int
    dtype: str  # the torch name: "float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"
    num_kv_heads: int
    head_dim: int
    num_layers: int
    # an fp8 element type's scales, one per layer (default 1.0 each); none for other types
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    key: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("a KV layout needs the model fingerprint")
        name = canonical_dtype(self.dtype)
        if name is None or not hasattr(torch, name):
            raise ValueError(f"unknown KV element type {self.dtype!r}")
        object.__setattr__(self, "dtype", name)
        for what in ("block_size", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be >= 1, got {getattr(self, what)}")
        parts = [
            LAYOUT_SCHEME,
            self.model_fingerprint.encode(),
            str(self.block_size).encode(),
            name.encode(),
            str(self.num_kv_heads).encode(),
            str(self.head_dim).encode(),
            str(self.num_layers).encode(),
            sys.byteorder.encode(),
            _PAYLOAD_ORDER,
        ]
        if name in FP8_ELEMENTS:
            for what in ("k_scales", "v_scales"):
                scales = tuple(float(x) for x in getattr(self, what)) or (1.0,) * self.num_layers
                if len(scales) != self.num_layers:
                    raise ValueError(f"{what}: {len(scales)} for {self.num_layers} layers")
                object.__setattr__(self, what, scales)
                parts.append(struct.pack(f"<{len(scales)}d", *scales))
        elif self.k_scales or self.v_scales:
            raise ValueError(f"scales are for an fp8 element type, not {name}")
        h = hashlib.sha256()
        for part in parts:
            h.update(_U32.pack(len(part)))
            h.update(part)
        object.__setattr__(self, "key", h.hexdigest())

    @classmethod
    def of_pool(cls, pool: KVPool, model_fingerprint: str) -> KVLayout:
        """The layout of `pool`'s blocks for the model with `model_fingerprint`."""
        # (the simulated pool has none)
        scales = (getattr(pool, "k_scales", ()), getattr(pool, "v_scales", ()))
        if str(pool.dtype).removeprefix("torch.") not in FP8_ELEMENTS:
            scales = (), ()
        return cls(
            model_fingerprint,
            pool.block_size,
            str(pool.dtype).removeprefix("torch."),
            pool.num_kv_heads,
            pool.head_dim,
            pool.num_layers,
            *scales,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's payload as a tensor: (2, layers, block size, KV heads, head dim)."""
        return (2, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload: K and V of every layer (the KV pool's per-block cost)."""
        itemsize = self.torch_dtype.itemsize
        return self.block_size * kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, itemsize
        )

    def check_pool(self, pool: KVPool) -> None:
        """ValueError unless `pool`'s blocks have this layout's shape and element type."""
        got = (pool.block_size, pool.dtype, pool.num_kv_heads, pool.head_dim, pool.num_layers)
        want = (
            self.block_size,
            self.torch_dtype,
            self.num_kv_heads,
            self.head_dim,
            self.num_layers,
        )
        if got != want:
            raise ValueError(f"KV pool {pool.describe()} does not have the layout {self}")
