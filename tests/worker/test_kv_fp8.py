"""The fp8 KV cache: the quantizer, the pool that stores with it, and every
attention backend reading it (the same poisoned-pool cases as test_attention)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_attention import (
    FP8_NAN,
    assert_matches,
    make_case,
    needs_triton_cpu,
    run_backend,
)
from worker.attention import check_kv_dtype, get_backend
from worker.kv_bytes import kv_cache_element
from worker.kv_pool import KVPool
from worker.kv_quant import dequantize, quantize
from worker.tiers.blocks import gather, scatter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]


def roundtrip(values: list[float], dtype: torch.dtype, scale: float = 1.0) -> list[float]:
    return dequantize(quantize(torch.tensor(values), scale, dtype), scale).tolist()


# -- the quantizer ----------------------------------------------------------------------


def test_e4m3_values_by_hand():
    # 3 mantissa bits, largest finite 448 = 1.75 * 2**8, smallest subnormal 2**-9, no inf
    assert roundtrip([1.0, 0.3, 250.0, 1000.0, -1e30, float("inf")], E4M3) == [
        1.0,
        0.3125,
        256.0,
        448.0,
        -448.0,
        448.0,
    ]
    # subnormals: multiples of 2**-9; halfway cases round to even
    ulp = 2.0**-9
    assert roundtrip([ulp, ulp / 2, 1.5 * ulp, 2.5 * ulp, ulp / 4], E4M3) == [
        ulp,
        0.0,
        2 * ulp,
        2 * ulp,
        0.0,
    ]


def test_e5m2_values_by_hand():
    # 2 mantissa bits, largest finite 57344 = 1.75 * 2**15, smallest subnormal 2**-16
    assert roundtrip([1.0, 0.3, 1000.0, 1e6, -1e30, float("inf")], E5M2) == [
        1.0,
        0.3125,
        1024.0,
        57344.0,
        -57344.0,
        57344.0,
    ]
    ulp = 2.0**-16
    assert roundtrip([ulp, ulp / 2, 1.5 * ulp, 3 * 2.0**-10], E5M2) == [
        ulp,
        0.0,
        2 * ulp,
        3 * 2.0**-10,
    ]


def test_scales_divide_on_write_and_multiply_on_read():
    # 1000 / 4 = 250 -> 256 -> 1024; 10 / 4 = 2.5 exactly
    assert roundtrip([1000.0, 10.0], E4M3, scale=4.0) == [1024.0, 10.0]
    # 2000 / 0.5 = 4000 saturates at 448 -> reads 224
    assert roundtrip([2000.0], E4M3, scale=0.5) == [224.0]


@pytest.mark.parametrize("dtype", FP8)
def test_no_nan_or_inf_from_finite_input(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.logspace(-40, 38, 4096)
    x = torch.cat(
        [
            x,
            torch.tensor(
                [torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0, -0.0]
            ),
        ]
    )
    for scale in (1.0, 1e-30, 1e30):
        q = quantize(x, scale, dtype)
        assert torch.isfinite(q.float()).all()
        top = torch.finfo(dtype).max
        assert (q.float().abs() <= top).all()


@pytest.mark.parametrize("dtype", FP8)
def test_relative_error_of_normal_values(dtype):
    # half an ulp of the mantissa: 2**-4 for e4m3, 2**-3 for e5m2
    x = torch.linspace(0.02, 400.0, 5000)
    err = ((dequantize(quantize(x, 1.0, dtype), 1.0) - x).abs() / x).max().item()
    assert err <= (2.0**-4 if dtype == E4M3 else 2.0**-3)


def test_kv_cache_element_names():
    assert kv_cache_element("auto", "bfloat16") == "bfloat16"
    assert kv_cache_element("fp8", "bfloat16") == "float8_e4m3fn"
    assert kv_cache_element("fp8_e4m3", "float32") == "float8_e4m3fn"
    assert kv_cache_element("fp8_e5m2", "float16") == "float8_e5m2"
    with pytest.raises(
        ValueError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"
    ):
        kv_cache_element("int8", "float32")


# -- the pool ---------------------------------------------------------------------------


def test_fp8_pool_holds_twice_bf16_and_four_times_float32():
    dims = dict(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
    blocks = {
        dt: KVPool.from_budget("8MiB", dtype=dt, **dims).num_blocks
        for dt in (torch.float32, torch.bfloat16, E4M3, E5M2)
    }
    assert blocks[E4M3] == blocks[E5M2] == 2 * blocks[torch.bfloat16] == 4 * blocks[torch.float32]


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pool_quantizes_per_layer_and_copies_bytes(dtype):
    pool = KVPool(2, 4, 2, 1, 4, dtype, k_scales=[1.0, 0.25], v_scales=[2.0, 1.0])
    k = torch.tensor([[[1.0, 3.0, -1000.0, 0.1]]])
    pool.write(1, torch.tensor([2]), k, k)
    assert pool.k_cache(1)[1, 0].float().tolist() == quantize(k[0], 0.25, dtype).float().tolist()
    assert pool.v_cache(1)[1, 0].float().tolist() == quantize(k[0], 1.0, dtype).float().tolist()
    assert (pool.k_scale(1), pool.v_scale(0)) == (0.25, 2.0)
    assert pool.k_cache(0).view(torch.uint8).sum() == 0  # layer 0 untouched
    raw = pool.k_blocks.view(torch.uint8)[:, 1].clone()
    pool.copy_blocks([(1, 3)])
    assert torch.equal(pool.k_blocks.view(torch.uint8)[:, 3], raw)
    # a tier's payload of an fp8 block is its bytes: out and back in elsewhere, unchanged
    payload = gather(pool, [1])
    assert payload.dtype == dtype
    scatter(pool, [0], payload)
    assert torch.equal(pool.k_blocks.view(torch.uint8)[:, 0], raw)


def test_scales_only_for_fp8_and_positive():
    with pytest.raises(ValueError, match="fp8 pool"):
        KVPool(1, 1, 1, 1, 1, torch.bfloat16, k_scales=[1.0])
    with pytest.raises(ValueError, match="positive finite"):
        KVPool(2, 1, 1, 1, 1, E4M3, k_scales=[1.0, 0.0])
    with pytest.raises(ValueError, match="positive finite"):
        KVPool(2, 1, 1, 1, 1, E4M3, v_scales=[1.0])


# -- attention over an fp8 pool ---------------------------------------------------------

# a prefill after a cached prefix, a fresh prefill, decodes, partly filled last blocks
SEQS = [(5, 7), (0, 9), (17, 1), (0, 1), (30, 1)]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("name", ["reference", "torch", "numba"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_fp8_equals_contiguous_on_dequantized_kv(name, dtype, block_size):
    case = make_case(
        SEQS, block_size, 6, 2, 16, seed=block_size, kv_dtype=dtype, kv_scales=(0.05, 3.0)
    )
    assert case.pool.k_cache(0).view(torch.uint8).eq(FP8_NAN).any(), "the free slots are poisoned"
    assert_matches(run_backend(name, case), case)


@pytest.mark.parametrize("name", ["torch", "numba"])
def test_decode_only_fp8_cache_under_bf16_queries(name):
    # the numba backend hands bf16 queries to the torch path, fp8 cache and all
    case = make_case(
        [(30, 1), (3, 1), (64, 1)],
        16,
        6,
        2,
        32,
        seed=3,
        dtype=torch.bfloat16,
        kv_dtype=E4M3,
        kv_scales=(0.5, 0.25),
    )
    out = run_backend(name, case)
    assert out.dtype == torch.bfloat16
    assert_matches(out, case, atol=3e-2)


@needs_triton_cpu
@pytest.mark.parametrize("dtype", FP8)
def test_triton_fp8_interpreted(dtype):
    # decodes by the kernel, the prefill by the torch path beside it; odd block size
    case = make_case(
        [(9, 1), (2, 1), (5, 6), (0, 1)], 3, 6, 2, 16, seed=4, kv_dtype=dtype, kv_scales=(0.05, 3.0)
    )
    assert_matches(run_backend("triton", case), case)


def test_fp8_e4m3_on_a_gpu_before_sm89_is_refused_for_triton_only():
    class Triton:
        def decode_fn(self):  # named as the kernel's entry point
            pass

    Triton.decode_fn.__name__ = "triton_decode"
    triton = Triton()
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*use fp8_e5m2"):
        check_kv_dtype(triton, E4M3, "cuda", capability=(8, 0))
    check_kv_dtype(triton, E4M3, "cuda", capability=(9, 0))
    check_kv_dtype(triton, E5M2, "cuda", capability=(8, 0))
    check_kv_dtype(get_backend("torch"), E4M3, "cuda", capability=(8, 0))
    check_kv_dtype(get_backend("reference"), E4M3, "cpu")
