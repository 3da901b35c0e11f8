"""Paged decode attention on the CPU, compiled by Numba: blocks are read in place.

The torch path gathers every key of the context into a buffer before its
matmul; on these CPUs that copy is most of the gap to contiguous SDPA. This
kernel is the CPU twin of the Triton one (`triton_decode.py`): one task per
decoding sequence walks its block table, reads each K block where it lies in
the pool (CHUNK blocks at a time), scores them for every query head, folds
them into an online softmax (running max, running sum, rescaled accumulator)
and adds their V rows at once. Nothing of size context is copied; a block's
`[block_size, Hkv, D]` is one contiguous run of memory, so it streams.

GQA: query head h reads kv head h // (Hq // Hkv); K and V are never repeated.
Only positions < context_len are read, so slots a sequence does not own (a
freed block's stale keys, a padded table entry) never reach the result.

float32 queries only (NumPy has no bfloat16): `PagedAttention` sends other
dtypes to the torch path. The cache is float32, or fp8 (NumPy has no fp8
either): its bytes are read as uint8 codes and decoded through a 256-entry
table of `float(code) * scale` per K and V, built per call; one kernel source
serves both, `_element` picks the read by the cache's element type. Sequences run in parallel on as
many threads as torch uses, so `--threads` governs both. The first call compiles (a few seconds),
and the machine code is cached on disk (`cache=True`; `NUMBA_CACHE_DIR` moves it).
`compile_kernels` does that when a float32 model is built with this backend
(`PagedAttention.prepare`), so no request waits for it; the CPU image runs it
at build time.

Threads: Numba's default OpenMP layer is a second OpenMP runtime beside
torch's, and its idle threads spin after each kernel: measured here, torch's
next ops ran 3-8x slower while they did. The "workqueue" layer parks its
threads instead; it must not be entered from two threads at once (it aborts
the process), so calls take a lock. NUMBA_THREADING_LAYER still overrides.
"""

from __future__ import annotations

import math
import os
import threading
import types

import numba
import numpy as np
import torch
from numba.core import types as nbtypes
from numba.extending import overload

from allocator_service.core import blocks_for
from worker.kv_quant import is_fp8

__all__ = ["DTYPES", "compile_kernels", "numba_decode"]

DTYPES = (torch.float32,)  # the query dtypes; the cache is of the same dtype or fp8
# (imported under any default device)
_CODES = torch.arange(256, dtype=torch.int32, device="cpu").to(torch.uint8)

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
_launch = threading.Lock()


# Blocks read together: a block is one contiguous run, but consecutive blocks of
# a table lie anywhere in the pool, and the hardware prefetcher starts over at
# each. Walking CHUNK blocks row by row keeps CHUNK streams in flight; measured
# here (64 x 2048 tokens, shuffled tables) 4 took 1.6x -> 1.3x of contiguous
# SDPA, 8 and 16 did no better.
CHUNK = 4

# The core's `blocks_for`, compiled so the kernel can call it.
_blocks_for = numba.njit(inline="always")(blocks_for)


def _element(table, x):  # pragma: no cover - replaced by the overload below in compiled code
    return table[x]


@overload(_element, inline="always")
def _element_impl(table, x):
    """A cache element as float32: itself, or an fp8 code's entry in `table`."""
    if isinstance(x, nbtypes.Float):
        return lambda table, x: x
    return lambda table, x: table[x]


def _paged_decode(
    out, q, k_cache, v_cache, k_table, v_table, block_tables, context_lens, scale
):  # pragma: no cover - compiled
    batch, num_q_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    group = num_q_heads // k_cache.shape[2]
    for s in numba.prange(batch):
        context = context_lens[s]
        qs = np.empty((num_q_heads, head_dim), dtype=np.float32)
        for h in range(num_q_heads):
            for d in range(head_dim):
                qs[h, d] = q[s, h, d] * scale
        running_max = np.full(num_q_heads, -np.inf, dtype=np.float32)
        running_sum = np.zeros(num_q_heads, dtype=np.float32)
        acc = np.zeros((num_q_heads, head_dim), dtype=np.float32)
        # [chunk position, head]
        scores = np.empty((CHUNK * block_size, num_q_heads), dtype=np.float32)
        blocks = np.empty(CHUNK, dtype=np.int64)
        num_blocks = _blocks_for(context, block_size)
        for first in range(0, num_blocks, CHUNK):
            width = min(CHUNK, num_blocks - first)
            for c in range(width):
                blocks[c] = block_tables[s, first + c]
            n = min(width * block_size, context - first * block_size)  # positions < context only
            # scores: row t of every block of the chunk, then row t + 1
            for t in range(block_size):
                for c in range(width):
                    i = c * block_size + t
                    if i < n:
                        block = blocks[c]  # hoisted: read once, not per element
                        for h in range(num_q_heads):
                            kv = h // group
                            dot = np.float32(0.0)
                            for d in range(head_dim):
                                dot += qs[h, d] * _element(k_table, k_cache[block, t, kv, d])
                            scores[i, h] = dot
            # online softmax: rescale what was summed under the old max
            for h in range(num_q_heads):
                new_max = running_max[h]
                for i in range(n):
                    if scores[i, h] > new_max:
                        new_max = scores[i, h]
                if new_max > running_max[h]:
                    alpha = math.exp(running_max[h] - new_max)
                    running_sum[h] *= alpha
                    for d in range(head_dim):
                        acc[h, d] *= alpha
                    running_max[h] = new_max
                for i in range(n):
                    p = math.exp(scores[i, h] - new_max)
                    scores[i, h] = p
                    running_sum[h] += p
            for t in range(block_size):
                for c in range(width):
                    i = c * block_size + t
                    if i < n:
                        block = blocks[c]
                        for h in range(num_q_heads):
                            kv = h // group
                            p = scores[i, h]
                            for d in range(head_dim):
                                acc[h, d] += p * _element(v_table, v_cache[block, t, kv, d])
        for h in range(num_q_heads):
            inv = 1.0 / running_sum[h]
            for d in range(head_dim):
                out[s, h, d] = acc[h, d] * inv


def _named(fn, name: str):
    """`fn` as a function of another name. NOTE: numba's on-disk cache is
    keyed by the function's qualified name and line, not by its flags: two
    builds of one function share one cache entry, and whichever is compiled
    first is loaded for both (measured: the serial build then ran the
    parallel one's code, ~110 us of thread-pool dispatch per call, 6x the
    kernel at one sequence of 256 tokens; or the parallel one ran serially)."""
    clone = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = name
    return clone


# One source, two builds: prange is a plain range in the serial one, which skips
# the thread pool's dispatch (a one-sequence batch or one thread gains nothing from it).
_serial = numba.njit(fastmath=True, cache=True, nogil=True)(
    _named(_paged_decode, "_paged_decode_serial")
)
_parallel = numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)(
    _named(_paged_decode, "_paged_decode_parallel")
)


def numba_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A `DecodeFn` (see `torch_paged`): q [b, Hq, D] -> [b, Hq, D]; float32 CPU tensors,
    the caches float32 or fp8 (read as `float(element) * k_scale` / `v_scale`)."""
    del max_context_len  # each task reads its own sequence's length
    fp8 = is_fp8(k_cache.dtype)
    if q.dtype not in DTYPES or not (fp8 or k_cache.dtype in DTYPES) or q.device.type != "cpu":
        raise ValueError(
            f"numba_decode takes float32 CPU queries over a float32 or fp8 cache, got {q.dtype} "
            f"over {k_cache.dtype} on {q.device}"
        )
    q = q.contiguous()  # a view of the qkv projection; one specialisation (C order) serves all
    out = torch.empty_like(q)
    if fp8:
        k_table, v_table = _table(k_cache.dtype, k_scale), _table(v_cache.dtype, v_scale)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_table = v_table = _NO_TABLE
    args = (
        out.numpy(),
        q.numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        k_table,
        v_table,
        block_tables.contiguous().numpy(),
        context_lens.contiguous().numpy(),
        scale,
    )
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, q.shape[0])
    if threads <= 1:
        _serial(*args)
        return out
    with _launch:
        # per calling thread in numba; torch's is the one --threads sets
        numba.set_num_threads(threads)
        _parallel(*args)
    return out


_NO_TABLE = np.zeros(0, dtype=np.float32)  # a float32 cache reads its elements directly


def _table(dtype: torch.dtype, scale: float) -> np.ndarray:
    """float32 [256]: what each fp8 code of `dtype` reads as, times `scale`."""
    return (_CODES.view(dtype).float() * scale).numpy()


def compile_kernels(cache_dtype: torch.dtype = torch.float32, parallel: bool | None = None) -> None:
    """Compile the builds calls over a `cache_dtype` cache (float32 or fp8) will
    use now (or load them from numba's disk cache, ~0.2 s), with the argument
    types of a real decode, rather than at a request's first decode: cold, the
    serial build took ~2 s and the parallel one ~4.6 s on the 2-CPU VM, a stall
    for every running request at the first decode of two or more sequences.
    `parallel`: compile the parallel build too (None: when calls can use it,
    more than one thread)."""
    if parallel is None:
        parallel = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS) > 1
    q = np.zeros((2, 1, 8), dtype=np.float32)
    fp8 = is_fp8(cache_dtype)
    cache = np.zeros((2, 4, 1, 8), dtype=np.uint8 if fp8 else np.float32)
    table = _table(cache_dtype, 1.0) if fp8 else _NO_TABLE
    args = (
        np.empty_like(q),
        q,
        cache,
        cache,
        table,
        table,
        np.array([[0], [1]], dtype=np.int32),
        np.array([1, 1], dtype=np.int32),
        1.0,
    )
    _serial(*args)
    if parallel:
        with _launch:
            _parallel(*args)
