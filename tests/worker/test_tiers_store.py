"""The shared store's byte movers (worker/tiers/): its `file://` and `redis://`
backends, their entries' checks and the store metrics (the KV layout, the host tier and
the entries themselves: tests/worker/test_tiers_bytes.py).

What a user would notice: the K/V a block gets back from the store is bit for bit what
was saved (so the tokens computed from it are the same), an entry of another layout or
with broken bytes is refused and counted, bad store URLs are one-line errors at start,
two processes share one store directory, and a store that dies mid-run turns into
misses, never an error.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from pagedkv.stack import free_port, start_redis
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
from worker.tiers import (
    HostMemory,
    KVLayout,
    LoadOutcome,
    StoreMover,
    StoreOpenError,
    encode_entry,
    entry_key,
    open_store,
)
from worker.tiers.entry import HEADER_BYTES

# ------------------------------------------------------------------ stores


@pytest.fixture(scope="module")
def redis_url(redis_store):
    with redis_store() as (url, _process):
        yield url


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path / 'kv'}")
    else:
        s = open_store(request.getfixturevalue("redis_url"))
    yield s
    s.close()


def test_a_store_keeps_bytes_by_key(store):
    assert store.get("absent") is None
    store.put("k-1", b"one")
    store.put_many([("k-2", b"two"), ("k-3", memoryview(b"three"))])
    assert store.get_many(["k-1", "k-2", "k-3", "k-4"]) == [b"one", b"two", b"three", None]
    store.put("k-1", b"uno")  # a second write replaces the first
    store.delete("k-2")
    store.delete("k-2")  # deleting an absent key is no error
    store.delete_many(["k-3", "k-9"])
    assert store.get_many(["k-1", "k-2", "k-3"]) == [b"uno", None, None]
    with pytest.raises(ValueError, match="a store key"):
        store.put("../escape", b"x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_to_store_to_kv_gives_the_same_bytes(store, dtype):
    pool = make_pool(dtype)
    layout = KVLayout.of_pool(pool, fingerprint())
    metrics = new_metrics()
    host = HostMemory(pool, 4)
    mover = StoreMover(store, layout, pool, host=host, meter=metrics.tier("shared"))
    saved = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    hs = hashes(6, layout.key)
    assert mover.save_blocks([3, 1, 4], hs[:3]) == [True] * 3
    # a host save beside the store's: the store reads KV blocks only
    host.save([5, 9, 2], [2, 0, 3])
    assert mover.save_blocks([5, 9, 2], hs[3:]) == [True] * 3
    fresh = make_pool(dtype, seed=1)
    pool.k_blocks.copy_(fresh.k_blocks)
    pool.v_blocks.copy_(fresh.v_blocks)
    overwritten = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    unknown = hashes(1, "never saved")
    got = mover.load_blocks([hs[5], hs[0], *unknown, hs[3], hs[1]], [0, 6, 7, 8, 9])
    assert got == [
        LoadOutcome(True),
        LoadOutcome(True),
        LoadOutcome(False, "missing"),
        LoadOutcome(True),
        LoadOutcome(True),
    ]
    want = overwritten | {0: saved[2], 6: saved[3], 8: saved[5], 9: saved[1]}
    assert {b: block_bytes(pool, b) for b in range(pool.num_blocks)} == want  # 7 untouched: a miss
    assert sample(metrics, "saved_blocks_total", "shared") == 6
    assert sample(metrics, "saved_bytes_total", "shared") == 6 * layout.block_bytes
    assert sample(metrics, "loaded_blocks_total", "shared") == 4
    assert sample(metrics, "loaded_bytes_total", "shared") == 4 * layout.block_bytes
    assert sample(metrics, "store_errors_total", "shared") == 0
    assert mover.delete(hs[:2])
    assert mover.load_blocks(hs[:2], [1, 2]) == [LoadOutcome(False, "missing")] * 2
    # the miss above too
    assert sample(metrics, "refused_entries_total", "shared", reason="missing") == 3


def test_wrong_layout_and_wrong_checksum_entries_are_refused_and_counted(store, caplog):
    pool = make_pool(torch.float32)
    layout = KVLayout.of_pool(pool, fingerprint())
    metrics = new_metrics()
    mover = StoreMover(store, layout, pool, meter=metrics.tier("shared"))
    hs = hashes(4, layout.key)
    assert mover.save_blocks([0, 1, 2, 3], hs) == [True] * 4
    key = entry_key(layout, hs[0])
    broken = bytearray(store.get(key))
    broken[HEADER_BYTES + 5] ^= 0x40  # one bit of K flipped in the store
    store.put(key, bytes(broken))
    other = KVLayout.of_pool(make_pool(torch.float32), fingerprint())  # another model's worker
    store.put(entry_key(layout, hs[1]), encode_entry(other, hs[1], block_bytes(pool, 1)))
    store.put(entry_key(layout, hs[2]), b"not an entry")
    before = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
    with caplog.at_level(logging.WARNING, logger="worker.tiers"):
        got = mover.load_blocks(hs, [5, 6, 7, 8])
    assert got == [
        LoadOutcome(False, "checksum"),
        LoadOutcome(False, "layout"),
        LoadOutcome(False, "format"),
        LoadOutcome(True),
    ]
    assert [o.refused for o in got] == [True, True, True, False]
    # never loaded
    assert {b: block_bytes(pool, b) for b in range(pool.num_blocks)} == before | {8: before[3]}
    for reason in ("checksum", "layout", "format"):
        assert sample(metrics, "refused_entries_total", "shared", reason=reason) == 1
    assert sample(metrics, "loaded_blocks_total", "shared") == 1
    assert sum("refused" in r.getMessage() for r in caplog.records) == 3


# ------------------------------------------------------------------ opening a store


def test_a_store_that_cannot_be_used_is_a_one_line_error_at_start(tmp_path):
    plain = tmp_path / "a-file"
    plain.write_text("")
    port = free_port("127.0.0.1")
    for url, pattern in (
        ("s3://bucket/kv", "unknown kind; use file://PATH, redis://HOST:PORT/DB or peer://"),
        ("file://", "give a directory"),
        (f"file://{plain}/kv", f"cannot write to {plain}/kv"),
        (f"redis://127.0.0.1:{port}/0", "unreachable"),
        ("redis://127.0.0.1:notaport/0", "shared store redis://127.0.0.1:notaport/0"),
    ):
        with pytest.raises(StoreOpenError, match=pattern) as err:
            open_store(url)
        assert "\n" not in str(err.value), url
        assert isinstance(err.value, ValueError)  # what the worker's start reports as a bad flag


# ------------------------------------------------------------------ two processes, one directory

_OTHER_WORKER = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.support.kv_bytes import make_pool, block_bytes, hashes
from worker.tiers import KVLayout, StoreMover, open_store
args = json.loads(sys.argv[1])
pool = make_pool(torch.bfloat16, seed=7)
mine = {{b: block_bytes(pool, b).hex() for b in range(pool.num_blocks)}}
layout = KVLayout.of_pool(pool, args["fingerprint"])
mover = StoreMover(open_store(args["url"]), layout, pool)
got = mover.load_blocks([bytes.fromhex(h) for h in args["load"]], [0, 1, 2])
ok = mover.save_blocks([4, 5], hashes(2, "second"))
print(json.dumps({{"got": [o.reason for o in got], "ok": ok, "mine": mine,
                  "after": {{b: block_bytes(pool, b).hex() for b in range(3)}}}}))
"""


def test_the_file_store_is_shared_by_two_processes(tmp_path):
    url = f"file://{tmp_path / 'shared'}"
    pool = make_pool(torch.bfloat16, seed=5)
    fp = fingerprint()
    layout = KVLayout.of_pool(pool, fp)
    mover = StoreMover(open_store(url), layout, pool)
    hs = hashes(3, "first")
    assert mover.save_blocks([8, 3, 6], hs) == [True] * 3
    args = json.dumps({"url": url, "fingerprint": fp, "load": [h.hex() for h in hs]})
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_WORKER.format(root=str(ROOT)), args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    other = json.loads(done.stdout.strip().splitlines()[-1])
    assert other["got"] == [None, None, None]  # all three loaded
    assert other["after"] == {str(i): block_bytes(pool, b).hex() for i, b in enumerate((8, 3, 6))}
    assert other["ok"] == [True, True]
    # and back: what the other process wrote loads here, as it was in its pool
    assert mover.load_blocks(hashes(2, "second"), [0, 1]) == [LoadOutcome(True)] * 2
    assert [block_bytes(pool, b).hex() for b in (0, 1)] == [other["mine"]["4"], other["mine"]["5"]]
    # nothing half-written is left where a reader looks: only whole entries, no temporaries
    entries = [p for p in (tmp_path / "shared").rglob("*") if p.is_file()]
    assert len(entries) == 5 and not [p for p in entries if p.name.endswith(".tmp")]


def test_a_file_store_write_that_fails_leaves_no_entry(tmp_path):
    store = open_store(f"file://{tmp_path / 'kv'}")
    pool = make_pool()
    metrics = new_metrics()
    mover = StoreMover(
        store,
        KVLayout.of_pool(pool, fingerprint()),
        pool,
        meter=metrics.tier("shared"),
        retry_interval_s=0,
    )
    good, bad = b"\0" * 32, b"\1" * 32
    assert mover.save_blocks([0], [good]) == [True]
    path = store._path(entry_key(mover.layout, bad))
    path.mkdir(parents=True)  # the entry's name is taken by a directory: the rename fails
    assert mover.save_blocks([1], [bad]) == [False]
    assert sample(metrics, "store_errors_total", "shared") == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert mover.load_blocks([good], [5]) == [LoadOutcome(True)] and mover.available
    assert block_bytes(pool, 5) == block_bytes(pool, 0)


# ------------------------------------------------------------------ a store that dies mid-run


def test_a_redis_store_killed_mid_run_degrades_to_misses(caplog):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    redis = start_redis()
    try:
        pool = make_pool(torch.float16)
        layout = KVLayout.of_pool(pool, fingerprint())
        metrics = new_metrics()
        now = [0.0]
        mover = StoreMover(
            open_store(redis.url),
            layout,
            pool,
            meter=metrics.tier("shared"),
            retry_interval_s=5.0,
            clock=lambda: now[0],
        )
        hs = hashes(4, "killed")
        assert mover.save_blocks([0, 1], hs[:2]) == [True, True]
        redis.kill()
        before = {b: block_bytes(pool, b) for b in range(pool.num_blocks)}
        with caplog.at_level(logging.WARNING, logger="worker.tiers"):
            assert mover.load_blocks(hs[:2], [5, 6]) == [LoadOutcome(False, "unavailable")] * 2
            assert not mover.available
            assert sample(metrics, "store_errors_total", "shared") == 1
            # within the retry interval the store is not asked: no wait, no new error
            assert mover.save_blocks([2], hs[2:3]) == [False]
            assert sample(metrics, "store_errors_total", "shared") == 1
            now[0] += 5.0
            assert mover.save_blocks([2, 3], hs[2:]) == [False, False]
            assert not mover.delete(hs[:1])
            now[0] += 5.0
            assert mover.load_blocks(hs[:1], [7]) == [LoadOutcome(False, "unavailable")]
            assert sample(metrics, "store_errors_total", "shared") == 3
            # once per outage
            assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
            assert {b: block_bytes(pool, b) for b in range(pool.num_blocks)} == before
            redis.start().wait_healthy(15)
            now[0] += 5.0
            assert mover.save_blocks([2, 3], hs[2:]) == [True, True]
            assert mover.available
            assert mover.load_blocks(hs[2:], [8, 9]) == [LoadOutcome(True)] * 2
            assert [block_bytes(pool, b) for b in (8, 9)] == [before[2], before[3]]
            redis.kill()  # a second outage warns again
            assert mover.load_blocks(hs[2:3], [4]) == [LoadOutcome(False, "unavailable")]
        assert sum("unreachable" in r.getMessage() for r in caplog.records) == 2
        assert sum("answers again" in r.getMessage() for r in caplog.records) == 1
        assert sample(metrics, "store_errors_total", "shared") == 4
    finally:
        redis.stop()
