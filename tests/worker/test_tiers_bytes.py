"""The KV tiers' byte movers (worker/tiers/): the KV layout, the host tier, the store
entries' checks and seals, and the tier metrics (the shared store's `file://` and
`redis://` backends: tests/worker/test_tiers_store.py).

What a user would notice: the K/V a block gets back is bit for bit what was saved
(so the tokens computed from it are the same), an entry of another layout or with
broken bytes is refused, and bad tier sizes are one-line errors at start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kv_bytes import (
    DTYPES,
    ROOT,
    block_bytes,
    fingerprint,
    hashes,
    make_pool,
    new_metrics,
    sample,
)
from worker.kv_pool import KVPool
from worker.tiers import (
    REFUSAL_REASONS,
    HostMemory,
    KVLayout,
    LoadOutcome,
    Refused,
    StoreMover,
    StoreSeal,
    decode_entry,
    encode_entry,
    entry_key,
    host_slots_for_size,
    open_store,
)
from worker.tiers.entry import HEADER_BYTES

# ------------------------------------------------------------------ layout


def test_the_layout_key_names_every_part_of_the_layout():
    base = KVLayout("a" * 64, 16, "float16", 8, 128, 32)
    assert base.key == KVLayout("a" * 64, 16, "fp16", 8, 128, 32).key  # a spelling is not a layout
    assert len(base.key) == 64 and int(base.key, 16) >= 0
    others = [
        KVLayout("b" * 64, 16, "float16", 8, 128, 32),
        KVLayout("a" * 64, 32, "float16", 8, 128, 32),
        KVLayout("a" * 64, 16, "bfloat16", 8, 128, 32),
        KVLayout("a" * 64, 16, "float16", 4, 128, 32),
        KVLayout("a" * 64, 16, "float16", 8, 64, 32),
        KVLayout("a" * 64, 16, "float16", 8, 128, 28),
    ]
    assert len({base.key, *(o.key for o in others)}) == 1 + len(others)
    assert base.block_bytes == 16 * 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pools_layout_has_its_blocks_bytes(dtype):
    pool = make_pool(dtype)
    layout = KVLayout.of_pool(pool, "f" * 64)
    assert layout.block_bytes == pool.bytes_total // pool.num_blocks == len(block_bytes(pool, 0))
    assert layout.torch_dtype == dtype
    with pytest.raises(ValueError, match="does not have the layout"):
        KVLayout("f" * 64, 8, layout.dtype, 2, 8, 3).check_pool(pool)


def test_fp8_layouts_differ_from_bf16_and_by_their_scales():
    bf16 = KVLayout("a" * 64, 16, "bfloat16", 8, 128, 2)
    e4m3 = KVLayout("a" * 64, 16, "float8_e4m3fn", 8, 128, 2)
    assert (
        e4m3.key == KVLayout("a" * 64, 16, "float8_e4m3fn", 8, 128, 2, (1.0, 1.0), (1.0, 1.0)).key
    )
    others = [
        KVLayout("a" * 64, 16, "float8_e5m2", 8, 128, 2),
        KVLayout("a" * 64, 16, "float8_e4m3fn", 8, 128, 2, (1.0, 0.5)),
        KVLayout("a" * 64, 16, "float8_e4m3fn", 8, 128, 2, (), (2.0, 1.0)),
    ]
    assert len({bf16.key, e4m3.key, *(o.key for o in others)}) == 2 + len(others)
    assert 2 * e4m3.block_bytes == bf16.block_bytes
    pool = KVPool(2, 3, 16, 8, 128, torch.float8_e4m3fn, k_scales=(1.0, 0.5))
    assert KVLayout.of_pool(pool, "a" * 64).key == others[1].key
    with pytest.raises(ValueError, match="scales are for an fp8"):
        KVLayout("a" * 64, 16, "bfloat16", 8, 128, 2, (1.0, 1.0))
    with pytest.raises(ValueError, match="2 layers"):
        KVLayout("a" * 64, 16, "float8_e5m2", 8, 128, 2, (1.0,))
    # an entry an fp8 pool wrote is refused by a bfloat16 pool's reader, as of another layout
    h = hashes(1)[0]
    got = decode_entry(encode_entry(e4m3, h, os.urandom(e4m3.block_bytes)), bf16, h)
    assert isinstance(got, Refused) and got.reason == "layout"


def test_the_layout_key_is_the_same_in_another_process():
    code = (
        "from worker.tiers import KVLayout;"
        "print(KVLayout('c' * 64, 16, 'bfloat16', 8, 128, 32).key)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert out == KVLayout("c" * 64, 16, "bfloat16", 8, 128, 32).key


# ------------------------------------------------------------------ host tier


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_to_host_to_kv_gives_the_same_bytes(dtype):
    pool = make_pool(dtype)
    metrics = new_metrics()
    host = HostMemory(pool, 6, meter=metrics.tier("host"))
    saved = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    # one batch: a run of slots (3, 4, 5) and single ones, in any order
    host.save([7, 2, 9, 0, 5], [3, 4, 5, 0, 2]).synchronize()
    assert [bytes(m) for m in host.read_slots([3, 4, 5, 0, 2])] == [
        saved[b] for b in (7, 2, 9, 0, 5)
    ]
    fresh = make_pool(dtype, seed=1)
    pool.k_blocks.copy_(fresh.k_blocks)
    pool.v_blocks.copy_(fresh.v_blocks)  # every block reused by other sequences
    overwritten = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    host.load([0, 3, 2, 5, 4], [1, 8, 6, 3, 4])
    host.wait()
    host.synchronize()
    want = dict(overwritten) | {1: saved[0], 8: saved[7], 6: saved[5], 3: saved[9], 4: saved[2]}
    assert {b: block_bytes(pool, b) for b in range(pool.num_blocks)} == want
    nbytes = 5 * host.block_bytes
    assert sample(metrics, "saved_blocks_total", "host") == 5
    assert sample(metrics, "saved_bytes_total", "host") == nbytes
    assert sample(metrics, "loaded_blocks_total", "host") == 5
    assert sample(metrics, "loaded_bytes_total", "host") == nbytes
    assert sample(metrics, "save_seconds_total", "host") > 0
    assert sample(metrics, "capacity_bytes", "host") == 6 * host.block_bytes
    assert sample(metrics, "used_bytes", "host") is None  # the engine's to set: not measured here


@settings(max_examples=40, deadline=None)
@given(
    moves=st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4)), min_size=0, max_size=6),
        ),
        max_size=8,
    )
)
def test_host_moves_match_a_model_of_slots_and_blocks(moves):
    """Any sequence of batched saves and loads leaves every KV block and every
    written slot holding what a dict of payloads says, and no other byte changes."""
    pool = make_pool(torch.float16, seed=3)
    host = HostMemory(pool, 5)
    blocks = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    slots: dict[int, bytes] = {}
    for is_save, pairs in moves:
        if is_save:
            pairs = list({s: (b, s) for b, s in pairs}.values())  # distinct slots
            host.save([b for b, _ in pairs], [s for _, s in pairs])
            slots.update({s: blocks[b] for b, s in pairs})
        else:
            # written slots, distinct blocks
            pairs = list({b: (b, s) for b, s in pairs if s in slots}.values())
            host.load([s for _, s in pairs], [b for b, _ in pairs])
            blocks.update({b: slots[s] for b, s in pairs})
        assert {b: block_bytes(pool, b) for b in range(pool.num_blocks)} == blocks
        assert {s: bytes(host.read_slots([s])[0]) for s in slots} == slots


def test_host_moves_refuse_bad_ids_and_touch_nothing():
    pool = make_pool()
    host = HostMemory(pool, 4)
    before = [block_bytes(pool, b) for b in range(pool.num_blocks)]
    with pytest.raises(ValueError, match="host slot 4 outside 0..3"):
        host.save([1], [4])
    with pytest.raises(ValueError, match="KV block 10 outside"):
        host.load([0], [10])
    with pytest.raises(ValueError, match="host slots repeat"):
        host.save([1, 2], [0, 0])
    with pytest.raises(ValueError, match="KV blocks repeat"):
        host.load([0, 1], [3, 3])
    with pytest.raises(ValueError, match="2 KV blocks but 1 host slots"):
        host.save([1, 2], [0])
    assert [block_bytes(pool, b) for b in range(pool.num_blocks)] == before


def test_the_offloading_size_in_gib_gives_slots_or_a_one_line_error():
    assert host_slots_for_size(0, 1024) == 0
    assert host_slots_for_size(1, 1024**2, available_bytes=2 * 1024**3) == 1024
    assert host_slots_for_size(0.5, 3 * 1024**2, available_bytes=2 * 1024**3) == 170
    for size, pattern in (
        (4, r"more than the memory available \(2.00 GiB\)"),
        (1e-9, r"holds no KV block \(1048576 B each\)"),
        (-1, "a number of GiB >= 0"),
        (float("nan"), "a number of GiB >= 0"),
    ):
        with pytest.raises(ValueError, match=pattern) as err:
            host_slots_for_size(size, 1024**2, available_bytes=2 * 1024**3)
        assert "\n" not in str(err.value) and "--kv-offloading-size" in str(err.value)
    with pytest.raises(ValueError, match="more than the memory available"):
        # the machine's MemAvailable
        HostMemory.from_size(make_pool(), 1e6)
    pool = make_pool()
    assert HostMemory.from_size(pool, 0) is None
    tier = HostMemory.from_size(pool, 1 / 1024, available_bytes=1024**3)  # 1 MiB
    assert tier is not None and tier.num_slots == 1024**2 // tier.block_bytes


# ------------------------------------------------------------------ entries


def test_an_entry_decodes_to_its_payload_and_every_mismatch_is_refused():
    layout = KVLayout("d" * 64, 4, "float32", 2, 8, 3)
    h = hashes(1)[0]
    payload = os.urandom(layout.block_bytes)
    entry = encode_entry(layout, h, payload)
    assert (
        len(entry) == HEADER_BYTES + layout.block_bytes
        and entry_key(layout, h) == f"{layout.key}-{h.hex()}"
    )
    assert bytes(decode_entry(entry, layout, h)) == payload

    def flip(at: int) -> bytes:
        b = bytearray(entry)
        b[at] ^= 0x01
        return bytes(b)

    other = KVLayout("e" * 64, 4, "float32", 2, 8, 3)
    cases = {
        "empty": (b"", "format"),
        "short": (entry[: HEADER_BYTES - 1], "format"),
        "magic": (flip(0), "format"),
        "version": (flip(4), "format"),
        "layout": (encode_entry(other, h, payload), "layout"),
        "hash": (encode_entry(layout, hashes(2)[1], payload), "checksum"),
        "truncated": (entry[:-1], "checksum"),
        "longer": (entry + b"\0", "checksum"),
        "payload": (flip(HEADER_BYTES + 17), "checksum"),
        "checksum": (flip(HEADER_BYTES - 1), "checksum"),
    }
    for name, (data, reason) in cases.items():
        got = decode_entry(data, layout, h)
        assert isinstance(got, Refused) and got.reason == reason, name
    assert set(REFUSAL_REASONS) - {"seal"} == {r for _, r in cases.values()}
    with pytest.raises(ValueError, match="block of layout"):
        encode_entry(layout, h, payload[:-1])


GROUP_KEY, OTHER_KEY = b"k" * 32, b"o" * 32


def test_a_sealed_entry_opens_only_under_its_key_and_store_key():
    """A worker with its store group's key reads only entries sealed under that key for
    the very store key it asked for; everything else (a plain entry with a valid
    checksum, another group's entry, a byte changed anywhere, an entry moved to
    another namespace) is refused as `seal` (or as its header's own mismatch)."""
    layout = KVLayout("d" * 64, 4, "float32", 2, 8, 3)
    h = hashes(1)[0]
    payload = os.urandom(layout.block_bytes)
    seal, other = StoreSeal(GROUP_KEY), StoreSeal(OTHER_KEY)
    ns = f"g1.{layout.key}"
    entry = encode_entry(layout, h, payload, seal=seal, namespace=ns)
    assert bytes(decode_entry(entry, layout, h, seal=seal, namespace=ns)) == payload
    # a reader without the key sees no K/V
    assert payload not in entry and payload[:64] not in entry
    # each sealing draws its own salt ...
    assert (
        bytes(
            decode_entry(
                encode_entry(layout, h, payload, seal=seal, namespace=ns),
                layout,
                h,
                seal=seal,
                namespace=ns,
            )
        )
        == payload
    )
    # ... so no two are alike
    assert encode_entry(layout, h, payload, seal=seal, namespace=ns) != entry

    def refused(data, **kw) -> str:
        got = decode_entry(data, layout, h, **{"seal": seal, "namespace": ns, **kw})
        assert isinstance(got, Refused), kw
        return got.reason

    flipped = [bytearray(entry) for _ in range(3)]
    for b, at in zip(
        flipped, (HEADER_BYTES - 1, HEADER_BYTES + 8 + 5, len(entry) - 1), strict=True
    ):
        b[at] ^= 0x01  # the salt, the ciphertext, the tag
    assert [refused(bytes(b)) for b in flipped] == ["seal"] * 3
    assert refused(encode_entry(layout, h, payload)) == "seal"  # plain, valid checksum: a forger's
    # another group's key
    assert refused(encode_entry(layout, h, payload, seal=other, namespace=ns)) == "seal"
    assert refused(entry, namespace=f"g2.{layout.key}") == "seal"  # moved to another group's key
    assert refused(entry, seal=None) == "seal"  # a worker without the key cannot read it
    assert refused(entry[:-1]) == "checksum"
    with pytest.raises(ValueError, match="32 bytes or more"):
        StoreSeal(b"short")


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_host_tier_is_pinned_and_copies_on_a_side_stream(tmp_path):
    pool = make_pool(torch.bfloat16, device="cuda")
    metrics = new_metrics()
    host = HostMemory(pool, 6, meter=metrics.tier("host"))
    assert host.pinned and host.cuda
    saved = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    transfer = host.save([7, 2, 9, 0], [3, 4, 5, 0])
    host.wait()  # the compute stream may now write the saved blocks
    pool.k_blocks.zero_()
    pool.v_blocks.zero_()
    host.load([0, 3, 5, 4], [1, 8, 6, 3])
    host.wait()
    torch.cuda.current_stream().synchronize()
    assert transfer.done()
    zero = block_bytes(pool, 0)
    want = {b: zero for b in range(pool.num_blocks)} | {
        1: saved[0],
        8: saved[7],
        6: saved[9],
        3: saved[2],
    }
    assert {b: block_bytes(pool, b) for b in range(pool.num_blocks)} == want
    host.synchronize()
    assert host.poll() == 0
    assert sample(metrics, "saved_blocks_total", "host") == 4
    assert sample(metrics, "loaded_bytes_total", "host") == 4 * host.block_bytes
    assert sample(metrics, "load_seconds_total", "host") > 0
    # a store mover on a CUDA pool: device -> store -> device, bit for bit, sealed
    mover = StoreMover(
        open_store(f"file://{tmp_path / 'kv'}"),
        KVLayout.of_pool(pool, fingerprint()),
        pool,
        host=host,
        seal=StoreSeal(GROUP_KEY),
    )
    # (loaded above: blocks 7's and 2's bytes)
    assert mover.save_blocks([8, 3], hashes(2, "gpu")) == [True, True]
    assert mover.load_blocks(hashes(2, "gpu"), [0, 2]) == [LoadOutcome(True)] * 2
    assert [block_bytes(pool, b) for b in (0, 2)] == [saved[7], saved[2]]
