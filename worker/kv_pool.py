"""The physical KV pool: every layer's K and V blocks, preallocated once.

Layout: per layer, K and V each look like `[num_blocks, block_size, num_kv_heads,
head_dim]`, so token position `p` of a sequence with block table `t` lives at
`[t[p // B], p % B]`, flat slot id `t[p // B] * B +
p % B` (docs/architecture.md, "The block contract").

Invariants:
- The pool never allocates after construction; block ids are `0..num_blocks-1`
  and mean nothing outside this pool (the allocator only hands them out).
- Memory starts zeroed, so a slot that was never written reads as finite data.
  Attention must still never read slots a sequence does not own: after a block
  is freed and reused, its old contents are another sequence's keys.
- Each layer's storage carries one hidden "trash" row after the last real slot.
  Writes with slot id -1 (padding tokens) land there, which keeps `write`
  free of host/device synchronisation (no boolean indexing on CUDA).
- An fp8 pool (`dtype` float8_e4m3fn or float8_e5m2) holds K/V quantized with
  one scale per layer for K and one for V (`k_scale(layer)`, `v_scale(layer)`,
  worker/kv_quant.py), fixed at construction: a stored byte means the same
  value for the pool's whole life, so block copies, swaps and tier moves copy
  bytes and nothing else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

import torch

from worker.kv_bytes import kv_bytes_per_token
from worker.kv_quant import is_fp8, quantize

__all__ = ["KVPool", "free_memory_bytes", "num_blocks_for_budget", "parse_memory"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(
    text: str | int | float,
    device: str | torch.device | None = None,
    free_bytes: Callable[[], int] | None = None,
) -> int:
    """Bytes meant by a memory size such as "2GiB", "512MiB", "1.5GB" or "1048576".

    Decimal units (KB, MB, GB, TB) are powers of 1000; binary units (KiB, MiB,
    GiB, TiB and the bare K, M, G, T) powers of 1024. A unitless number in
    (0, 1] is a fraction of the memory free right now on `device`: on CUDA
    `torch.cuda.mem_get_info`, on the CPU the kernel's MemAvailable. So "0.5"
    is half the free memory, and "1" is all of it, not one byte. `free_bytes`
    tells the free memory instead (a simulated device's).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"memory size must be >= 0, got {text}")
        return text
    match = _MEMORY_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"cannot read memory size {text!r}; use e.g. '2GiB', '512MiB', '1.5GB' or '0.5'"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(
            f"unknown memory unit {match.group(2)!r} in {text!r}; known: {sorted(_UNITS)}"
        )
    if unit == "" and 0 < number <= 1:
        return int(number * (free_bytes() if free_bytes is not None else free_memory_bytes(device)))
    return int(number * _UNITS[unit])


def free_memory_bytes(device: str | torch.device | None) -> int:
    """Bytes free right now on `device`: on CUDA `torch.cuda.mem_get_info`, on the CPU
    (or None) the kernel's MemAvailable."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev is not None and dev.type != "cpu":
        raise ValueError(f"a memory fraction needs a cuda or cpu device, got {dev}")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Not Linux: free physical pages are a conservative stand-in for "available".
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_block(
    num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs across all layers, K and V together."""
    return block_size * kv_bytes_per_token(num_layers, kv_heads, head_dim, dtype.itemsize)


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> int:
    """How many whole blocks fit in `budget_bytes` (K and V of every layer)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // bytes_per_block(num_layers, kv_heads, head_dim, block_size, dtype)


class KVPool:
    """Preallocated K/V blocks for every layer of one model on one device.

    `k_cache(layer)` / `v_cache(layer)` are views `[num_blocks, block_size,
    num_kv_heads, head_dim]` into one tensor per K and V holding all layers, so
    `copy_blocks` moves a block in every layer with a single indexing op.
    `k_scales`/`v_scales` (one float per layer, default 1.0) are an fp8 pool's
    quantization scales; other pools store K/V as given and take none.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        num_slots = num_blocks * block_size
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)  # +1: the trash row
        self.fp8 = is_fp8(dtype)
        self._k_scales = self._scales("k_scales", k_scales)
        self._v_scales = self._scales("v_scales", v_scales)
        # fp8: bytes viewed as fp8 (torch's CPU index_copy_ takes no fp8; `write` uses the bytes)
        storage = torch.uint8 if self.fp8 else dtype
        self._k = torch.zeros(shape, dtype=storage, device=self.device).view(dtype)
        self._v = torch.zeros(shape, dtype=storage, device=self.device).view(dtype)
        block_shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Views without the trash row; splitting dim 1 keeps them views.
        self._k_blocks = self._k[:, :num_slots].view(block_shape)
        self._v_blocks = self._v[:, :num_slots].view(block_shape)
        self._trash_slot = num_slots

    def _scales(self, what: str, scales: Sequence[float] | None) -> tuple[float, ...]:
        if scales is None:
            return (1.0,) * self.num_layers
        if not self.fp8:
            raise ValueError(f"{what} are for an fp8 pool, not {self.dtype}")
        out = tuple(float(x) for x in scales)
        if len(out) != self.num_layers or not all(0 < x < float("inf") for x in out):
            raise ValueError(
                f"{what} must be {self.num_layers} positive finite floats, got {scales!r}"
            )
        return out

    @classmethod
    def from_budget(
        cls,
        budget: str | int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """A pool as large as `budget` allows ("2GiB", "0.5" of free memory, bytes)."""
        budget_bytes = parse_memory(budget, device)
        blocks = num_blocks_for_budget(
            budget_bytes, num_layers, num_kv_heads, head_dim, block_size, dtype
        )
        if blocks < 1:
            need = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
            raise ValueError(f"KV budget {budget!r} ({budget_bytes} B) holds no block of {need} B")
        return cls(num_layers, blocks, block_size, num_kv_heads, head_dim, dtype, device)

    # -- access -----------------------------------------------------------------

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys, `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self._k_blocks[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s values, same shape as `k_cache(layer)`."""
        return self._v_blocks[layer]

    def k_scale(self, layer: int) -> float:
        """Layer `layer`'s K scale: a stored key reads as `float(k) * k_scale` (1.0 unless fp8)."""
        return self._k_scales[layer]

    def v_scale(self, layer: int) -> float:
        """Layer `layer`'s V scale, as `k_scale`."""
        return self._v_scales[layer]

    @property
    def k_scales(self) -> tuple[float, ...]:
        """Every layer's K scale."""
        return self._k_scales

    @property
    def v_scales(self) -> tuple[float, ...]:
        """Every layer's V scale."""
        return self._v_scales

    @property
    def k_blocks(self) -> torch.Tensor:
        """Every layer's keys, `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`
        (a view: indexing dim 1 moves blocks in all layers at once)."""
        return self._k_blocks

    @property
    def v_blocks(self) -> torch.Tensor:
        """Every layer's values, same shape as `k_blocks`."""
        return self._v_blocks

    @property
    def bytes_total(self) -> int:
        """Bytes of K/V the pool holds (all layers, excluding the trash rows)."""
        return self.num_blocks * bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )

    @property
    def tokens_capacity(self) -> int:
        """Token slots in the pool: how many token positions fit, summed over sequences."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        gib = self.bytes_total / 1024**3
        return (
            f"{self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.tokens_capacity} tokens, {self.bytes_total} B ({gib:.3f} GiB), "
            f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} dim, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device}"
        )

    # -- mutation ---------------------------------------------------------------

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new tokens' K/V: row `i` of `k`/`v` ([T, kv_heads, head_dim]) goes to slot
        `slot_mapping[i]`; slot -1 means skip (the row lands in the trash row).
        An fp8 pool stores them quantized with the layer's scales.

        Slots must be distinct apart from -1 (two writes to one slot race on CUDA).
        """
        if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"write shapes disagree: k {tuple(k.shape)}, v "
                f"{tuple(v.shape)}, slots {tuple(slot_mapping.shape)}"
            )
        slots = torch.where(slot_mapping < 0, self._trash_slot, slot_mapping)
        if self.fp8:
            raw = torch.uint8
            k = quantize(k, self._k_scales[layer], self.dtype)
            v = quantize(v, self._v_scales[layer], self.dtype)
            self._k[layer].view(raw).index_copy_(0, slots, k.view(raw))
            self._v[layer].view(raw).index_copy_(0, slots, v.view(raw))
            return
        self._k[layer].index_copy_(0, slots, k.to(self.dtype))
        self._v[layer].index_copy_(0, slots, v.to(self.dtype))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply (src, dst) block copies in every layer (copy-on-write).

        All sources are read before any destination is written, so a block that
        is both a source and a destination in one call gives its old contents.
        Destinations must be distinct.
        """
        if not copies:
            return
        for src, dst in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise IndexError(
                    f"block copy {src}->{dst} outside pool of {self.num_blocks} blocks"
                )
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        # Advanced indexing on the right makes a copy first: this is what gives
        # the read-all-then-write-all semantics documented above.
        k, v = self._k_blocks, self._v_blocks
        if self.fp8:  # the bytes: not every device's index_put takes fp8
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]
