"""Paged attention and the KV pool: paged results equal contiguous attention.

Every case NaN-poisons the whole pool first and writes only the slots the
sequences own, and pads block tables with a poisoned block: a backend that
reads one slot it does not own returns NaN.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.attention import AttentionMetadata, get_backend, select_backend
from worker.kv_pool import KVPool, num_blocks_for_budget, parse_memory
from worker.kv_quant import dequantize, is_fp8, quantize

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# The interpreter runs the kernel on CPU tensors (tests/conftest.py turns it on
# when there is no GPU); it must be on before the kernel module is imported.
TRITON_ON_CPU = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
needs_triton_cpu = pytest.mark.skipif(
    not TRITON_ON_CPU, reason="needs triton with TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FP8_NAN = 0x7F  # a NaN code in both fp8 formats: poisons an fp8 pool


# -- a batch on a poisoned pool, and its contiguous ground truth ---------------------


@dataclass
class Case:
    pool: KVPool
    meta: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per sequence, contiguous [ctx, Hkv, D]
    values: list[torch.Tensor]
    scale: float


def make_case(
    seqs: list[tuple[int, int]],  # (num_computed, num_new) per sequence
    block_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 3,
    data_seed: int | None = None,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Case:
    """`kv_dtype` (fp8): the pool's element type, with `kv_scales`; the case's
    contiguous K/V are then what the pool reads back (dequantized)."""
    rng = random.Random(seed)  # block layout
    gen = torch.Generator().manual_seed(seed if data_seed is None else data_seed)  # contents
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + spare_blocks
    fp8 = kv_dtype is not None and is_fp8(kv_dtype)
    scales = {"k_scales": [kv_scales[0]], "v_scales": [kv_scales[1]]} if fp8 else {}
    pool = KVPool(
        1, num_blocks, block_size, kv_heads, head_dim, kv_dtype or dtype, device, **scales
    )
    for cache in (pool.k_cache(0), pool.v_cache(0)):
        if fp8:
            cache.view(torch.uint8).fill_(FP8_NAN)
        else:
            cache.fill_(float("nan"))
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # interleaved, non-adjacent tables
    poisoned_spare = ids[-1]
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    keys = [
        torch.randn(c + n, kv_heads, head_dim, generator=gen).to(device, dtype) for c, n in seqs
    ]
    values = [
        torch.randn(c + n, kv_heads, head_dim, generator=gen).to(device, dtype) for c, n in seqs
    ]
    # Write every owned position (the cached prefix and this step's tokens):
    # the model writes new tokens before attention, so by then all are present.
    everything = AttentionMetadata.build(
        [(t, 0, c + n) for t, (c, n) in zip(tables, seqs, strict=True)], block_size, device
    )
    pool.write(0, everything.slot_mapping, torch.cat(keys), torch.cat(values))
    if fp8:
        keys = [dequantize(quantize(k, kv_scales[0], kv_dtype), kv_scales[0], dtype) for k in keys]
        values = [
            dequantize(quantize(v, kv_scales[1], kv_dtype), kv_scales[1], dtype) for v in values
        ]
    meta = AttentionMetadata.build(
        [(t, c, n) for t, (c, n) in zip(tables, seqs, strict=True)],
        block_size,
        device,
        pad_block_id=poisoned_spare,
    )
    q = torch.randn(meta.num_tokens, q_heads, head_dim, generator=gen).to(device, dtype)
    return Case(pool, meta, q, keys, values, head_dim**-0.5)


def contiguous_attention(case: Case) -> torch.Tensor:
    """Plain causal attention per sequence on contiguous K/V (no block tables)."""
    outs, start = [], 0
    for k, v, new in zip(case.keys, case.values, case.meta.host_query_lens, strict=True):
        ctx = k.shape[0]
        group = case.q.shape[1] // k.shape[1]
        q = case.q[start : start + new].float().transpose(0, 1)  # [Hq, new, D]
        kk = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        vv = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - new, ctx)[:, None]
        scores = (q @ kk.transpose(1, 2)) * case.scale
        probs = scores.masked_fill(~allowed.to(q.device), float("-inf")).softmax(-1)
        outs.append((probs @ vv).transpose(0, 1))
        start += new
    return torch.cat(outs)


def run_backend(name: str, case: Case) -> torch.Tensor:
    backend = get_backend(name)
    return backend(
        case.q,
        case.pool.k_cache(0),
        case.pool.v_cache(0),
        case.meta,
        case.scale,
        case.pool.k_scale(0),
        case.pool.v_scale(0),
    )


def assert_matches(out: torch.Tensor, case: Case, atol: float = 2e-5) -> None:
    assert torch.isfinite(out).all(), "a slot the sequence does not own leaked into the result"
    torch.testing.assert_close(out.float(), contiguous_attention(case), atol=atol, rtol=atol)


# -- the sweep ------------------------------------------------------------------------

HEADS = [(6, 2), (4, 4), (2, 1), (8, 2)]


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    q_heads, kv_heads = draw(st.sampled_from(HEADS))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    all_decode = draw(st.booleans())
    n = draw(st.integers(1, 4))
    seqs = []
    for _ in range(n):
        computed = draw(st.integers(0, 40))
        if all_decode or draw(st.booleans()):
            seqs.append((max(computed, 0), 1))
        else:
            seqs.append((computed, draw(st.integers(1, 20))))
    return seqs, block_size, q_heads, kv_heads, head_dim, draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_paged_equals_contiguous(batch):
    seqs, block_size, q_heads, kv_heads, head_dim, seed = batch
    case = make_case(seqs, block_size, q_heads, kv_heads, head_dim, seed)
    for name in ("reference", "torch", "numba"):
        assert_matches(run_backend(name, case), case)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_with_cached_prefix(block_size):
    # prefill after a cached prefix, fresh prefill, two decodes, a partly filled last block
    case = make_case([(5, 7), (0, 9), (17, 1), (0, 1)], block_size, 6, 2, 16, seed=block_size)
    for name in ("reference", "torch", "numba"):
        assert_matches(run_backend(name, case), case)


@pytest.mark.parametrize("name", ["torch", "numba"])
def test_decode_only_fast_path_bf16(name):
    # the numba backend hands bf16 (no NumPy dtype) to the torch path
    case = make_case([(30, 1), (3, 1), (64, 1)], 16, 6, 2, 32, seed=3, dtype=torch.bfloat16)
    out = run_backend(name, case)
    assert out.dtype == torch.bfloat16
    assert_matches(out, case, atol=3e-2)


@st.composite
def decode_batches(draw):
    """Decode-only batches with contexts spanning many
    blocks, partial last blocks and GQA ratios."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    q_heads, kv_heads = draw(st.sampled_from([(9, 3), (4, 4), (8, 1), (6, 2)]))
    head_dim = draw(st.sampled_from([8, 64]))
    contexts = draw(st.lists(st.integers(1, 200), min_size=1, max_size=6))
    return (
        [(c - 1, 1) for c in contexts],
        block_size,
        q_heads,
        kv_heads,
        head_dim,
        draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_batches())
def test_numba_decode_matches_reference(batch):
    """The block-wise kernel (online softmax over blocks read in place) equals the
    reference on random shuffled block tables; the pool outside owned slots is NaN."""
    seqs, block_size, q_heads, kv_heads, head_dim, seed = batch
    case = make_case(seqs, block_size, q_heads, kv_heads, head_dim, seed)
    out = run_backend("numba", case)
    assert torch.isfinite(out).all(), "a slot the sequence does not own leaked into the result"
    torch.testing.assert_close(out, run_backend("reference", case), atol=2e-5, rtol=2e-5)


def test_numba_decode_reads_a_strided_query():
    # q is a view of the fused projection in the model: not contiguous
    case = make_case([(40, 1), (7, 1)], 4, 6, 2, 16, seed=11)
    wide = torch.cat([case.q, torch.zeros_like(case.q)], dim=-1)[..., : case.q.shape[-1]]
    assert not wide.is_contiguous()
    out = get_backend("numba")(
        wide, case.pool.k_cache(0), case.pool.v_cache(0), case.meta, case.scale
    )
    assert_matches(out, case)


def test_numba_serial_and_parallel_builds_each_compute_and_cache_their_own(tmp_path):
    """Both builds of the kernel give the reference's answer, and each keeps
    its own entry in numba's on-disk cache: numba keys that cache by the
    function's name, not its flags, so one entry for both made the serial
    build (one sequence, one thread) load the parallel one's code and pay the
    thread pool's dispatch on every call (or the parallel one run serially)."""
    code = (
        "import numpy as np\n"
        "from worker.attention import cpu_decode as cd\n"
        "rng = np.random.default_rng(0)\n"
        "k = rng.standard_normal((8, 4, 2, 8), dtype=np.float32); v = k[::-1].copy()\n"
        "q = rng.standard_normal((3, 4, 8), dtype=np.float32)\n"
        "tables = np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int32); lens = np.array([5, 8, 1], "
        "dtype=np.int32)\nouts = []\n"
        "for build in (cd._parallel, cd._serial):\n"
        "    out = np.empty_like(q); build(out, q, k, v, cd._NO_TABLE, cd._NO_TABLE, tables, lens, "
        "0.25)\n    outs.append(out)\n"
        "assert np.allclose(outs[0], outs[1], atol=1e-6)\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        timeout=300,
    )
    indexes = sorted(p.name.split("-")[0] for p in tmp_path.rglob("*.nbi"))
    assert indexes == ["cpu_decode._paged_decode_parallel", "cpu_decode._paged_decode_serial"], (
        indexes
    )
    from worker.attention import cpu_decode

    case = make_case([(40, 1), (7, 1), (0, 1)], 4, 6, 2, 16, seed=5)
    for build in (cpu_decode._serial, cpu_decode._parallel):
        out = torch.empty_like(case.q)
        q, k, v, tables, lens = [
            t.contiguous().numpy()
            for t in (
                case.q,
                case.pool.k_cache(0),
                case.pool.v_cache(0),
                case.meta.block_tables,
                case.meta.context_lens,
            )
        ]
        build(
            out.numpy(),
            q,
            k,
            v,
            cpu_decode._NO_TABLE,
            cpu_decode._NO_TABLE,
            tables,
            lens,
            case.scale,
        )
        assert_matches(out, case)


def test_a_float32_cpu_model_compiles_its_kernel_at_load_and_others_do_not():
    """Loading a float32 model on the CPU compiles (or loads) the kernel
    builds decodes will use, with a real decode's argument types: no request
    then waits seconds for numba at its first decode, batched or alone (a
    different type would compile a second signature while serving). A
    bfloat16 model never runs the kernel, and compiles nothing."""
    code = (
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "from worker.attention import cpu_decode as cd\n"
        "from worker.model.loader import load_model\n"
        "def built():\n"
        "    return (list(cd._serial.signatures), list(cd._parallel.signatures))\n"
        "load_model('tiny-random', dtype='bfloat16')\n"
        "assert built() == ([], []), built()\n"
        "loaded = load_model('tiny-random')\n"
        "at_load = built()\n"
        "assert [len(b) for b in at_load] == [1, 1], at_load\n"
        "from worker.engine import EngineConfig, LLMEngine, SamplingParams\n"
        "engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4))\n"
        "greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)\n"
        "engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]], greedy)\n"
        "engine.generate([[9, 10]], greedy)\n"
        "assert built() == at_load\n"
    )
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        timeout=300,
    )


def test_one_backend_serves_many_layers_and_steps():
    # The torch backend caches its gather plan per metadata object: the same plan
    # must serve every layer of a step, and a new step must not reuse it.
    backend = get_backend("torch")
    for step in range(3):
        seqs = [(10 + step, 1), (2, 1), (step, 3)]
        a = make_case(seqs, 4, 4, 2, 8, seed=step)
        b = make_case(seqs, 4, 4, 2, 8, seed=step, data_seed=100 + step)  # same layout, other data
        b.meta = a.meta  # one metadata object per step, as the model passes it to every layer
        for case in (a, b):
            assert_matches(
                backend(case.q, case.pool.k_cache(0), case.pool.v_cache(0), a.meta, case.scale),
                case,
            )


def test_select_backend():
    assert get_backend("torch").__class__.__name__ == "PagedAttention"
    assert get_backend("torch").decode_fn is None
    from worker.attention.cpu_decode import numba_decode

    assert select_backend("cpu").decode_fn is numba_decode
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


# -- Triton ---------------------------------------------------------------------------


@needs_triton_cpu
@pytest.mark.parametrize(
    "block_size,seqs",
    [
        (1, [(4, 1), (0, 1), (6, 1)]),
        (4, [(9, 1), (2, 1), (5, 6)]),  # includes a prefill, served by torch alongside
        (16, [(20, 1), (0, 1)]),
    ],
)
def test_triton_kernel_interpreted(block_size, seqs):
    case = make_case(seqs, block_size, 6, 2, 16, seed=block_size)
    assert_matches(run_backend("triton", case), case)


@needs_triton_cpu
def test_triton_kernel_odd_shapes():
    # head_dim and block size that are not powers of two: padded lanes are masked
    case = make_case([(7, 1), (1, 1)], 3, 3, 1, 24, seed=5)
    assert_matches(run_backend("triton", case), case)


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.attention import triton_decode as td

fn = td.paged_decode_kernel
for dtype, kv_dtype, block_size, head_dim in (("fp16", "fp16", 16, 64), ("bf16", "bf16", 16, 128),
                                              ("fp32", "fp32", 1, 64), ("bf16", "fp8e4nv", 16, 128),
                                              ("fp16", "fp8e5", 16, 64)):
    signature = {name: "i32" for name in fn.arg_names}
    for name in ("out_ptr", "q_ptr"):
        signature[name] = "*" + dtype
    for name in ("k_ptr", "v_ptr"):
        signature[name] = "*" + kv_dtype
    signature.update(block_tables_ptr="*i32", context_lens_ptr="*i32", scale="fp32", k_scale="fp32",
                     v_scale="fp32")
    constexprs = td.kernel_constexprs(9, 3, block_size, head_dim, kv_dtype.startswith("fp8"))
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn, signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"], "no cubin"
print("ok")
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_triton_kernel_compiles_for_sm90():
    """A real sm_90 build (ptxas ships in the triton wheel): catches GPU-only errors.

    In a fresh process: the interpreter, once used, patches triton.language in
    place and the compiler can no longer run in that process.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_on_cuda(dtype):
    case = make_case(
        [(100, 1), (5, 1), (33, 1), (0, 17), (40, 9)],
        16,
        9,
        3,
        64,
        seed=1,
        dtype=dtype,
        device="cuda",
    )
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    assert_matches(run_backend("triton", case), case, atol=atol)
    assert select_backend("cuda").decode_fn is not None


# -- KV pool --------------------------------------------------------------------------


def test_write_skips_minus_one_and_copy_blocks_copies_every_layer():
    pool = KVPool(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    for layer in range(3):
        k = torch.randn(8, 2, 8, generator=gen)
        slots = torch.tensor([8, 9, 10, 11, -1, 12, -1, 13])  # blocks 2 and 3; two skipped rows
        pool.write(layer, slots, k, -k)
        assert torch.equal(pool.k_cache(layer)[2], k[:4])
        assert torch.equal(pool.v_cache(layer)[3, :2], -k[[5, 7]])
    untouched = [0, 1, 4, 5]
    assert all(pool.k_cache(layer)[untouched].abs().sum() == 0 for layer in range(3))

    before = [(pool.k_cache(i)[2].clone(), pool.v_cache(i)[3].clone()) for i in range(3)]
    pool.copy_blocks([(2, 5), (3, 0)])
    for layer, (k2, v3) in enumerate(before):
        assert torch.equal(pool.k_cache(layer)[5], k2)
        assert torch.equal(pool.v_cache(layer)[0], v3)
    with pytest.raises(IndexError):
        pool.copy_blocks([(0, 6)])


def test_copy_blocks_then_attention_reads_the_copy():
    case = make_case([(9, 1)], 4, 4, 2, 8, seed=7, spare_blocks=3)
    table = case.meta.block_tables[0].tolist()[:3]
    used = set(table)
    free = [b for b in range(case.pool.num_blocks) if b not in used]
    # Copy-on-write of the last (partly filled) block, then point the table at the copy.
    case.pool.copy_blocks([(table[-1], free[0])])
    moved = table[:-1] + [free[0]]
    case.meta = AttentionMetadata.build([(moved, 9, 1)], 4)
    for name in ("torch", "numba"):
        assert_matches(run_backend(name, case), case)


def test_copy_blocks_reads_all_sources_first():
    pool = KVPool(1, 3, 2, 1, 2)
    pool.write(
        0, torch.arange(6), torch.arange(6.0)[:, None, None].expand(6, 1, 2), torch.zeros(6, 1, 2)
    )
    pool.copy_blocks([(0, 1), (1, 2)])  # block 2 gets the OLD block 1
    assert pool.k_cache(0)[:, :, 0, 0].tolist() == [[0, 1], [0, 1], [2, 3]]


def test_pool_sizes_and_budget():
    pool = KVPool(num_layers=30, num_blocks=100, block_size=16, num_kv_heads=3, head_dim=64)
    assert pool.tokens_capacity == 1600
    assert pool.bytes_total == 2 * 30 * 3 * 64 * 4 * 1600
    assert "100 blocks" in pool.describe() and "1600 tokens" in pool.describe()
    per_block = 2 * 30 * 16 * 3 * 64 * 2
    assert num_blocks_for_budget(10 * per_block + 5, 30, 3, 64, 16, torch.bfloat16) == 10
    small = KVPool.from_budget("1MiB", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    assert small.bytes_total <= 2**20 < small.bytes_total + 2 * 2 * 4 * 2 * 8 * 4
    with pytest.raises(ValueError, match="holds no block"):
        KVPool.from_budget("10B", 2, 4, 2, 8)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("100 MB", 100_000_000),
        ("64k", 65536),
        ("1048576", 1048576),
        (4096, 4096),
        ("3B", 3),
    ],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


def test_parse_memory_fraction_and_errors():
    half = parse_memory("0.5", "cpu")
    # memory moves a bit
    assert 0 < half and abs(parse_memory("1", "cpu") / 2 - half) < 0.2 * half + 2**26
    for bad in ("lots", "2 parsecs", "-1GiB", ""):
        with pytest.raises(ValueError):
            parse_memory(bad)


# -- metadata ---------------------------------------------------------------------------


def test_metadata_build():
    meta = AttentionMetadata.build([([7, 2], 3, 2), ([5], 0, 1), ([1, 4, 6], 8, 1)], block_size=4)
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 5 * 4 + 0, 6 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 2, 3, 4]
    assert meta.context_lens.tolist() == [5, 1, 9]
    assert meta.block_tables.shape == (3, 3) and meta.block_tables.dtype == torch.int32
    assert meta.positions().tolist() == [3, 4, 0, 8]
    assert meta.last_token_indices().tolist() == [1, 2, 3]
    assert not meta.is_decode_only and meta.max_context_len == 9


@pytest.mark.parametrize(
    "seqs,match",
    [([([0], 0, 5)], "cannot hold"), ([([0], 2, 0)], "num_new >= 1"), ([], "at least one")],
)
def test_metadata_rejects_bad_batches(seqs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(seqs, block_size=4)


# -- the benchmark runs (figures are not asserted) ------------------------------------


def test_bench_attention_smoke(capsys):
    import argparse
    import json

    from pagedkv.bench import attention as bench_attention

    parser = argparse.ArgumentParser()
    bench_attention.add_arguments(parser)
    args = parser.parse_args(
        ["--workload", "small", "--repeats", "1", "--backend", "torch,numba", "--json"]
    )
    assert bench_attention.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backends"] == ["torch", "numba"]
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for name in ("torch", "numba"):
        assert all(
            r[name]["max_abs_diff"] < 1e-4 and r[name]["ratio"] > 0 for r in report["results"]
        )
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "flash"])
