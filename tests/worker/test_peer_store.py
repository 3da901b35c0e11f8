"""The `peer://` store's bytes (worker/tiers/store.py `PeerStore`): a worker's
entries pulled by another over real HTTP come back bit for bit; an answer
whose bytes were altered is refused by the same checks as any store entry
(never loaded); a writer that does not answer, or refuses the caller's key,
is a miss (`unavailable`, not refused: the entry may be fine); the writer's
memory stays within the store's size; bad URLs are one-line errors."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tests.support.kv_bytes import block_bytes, fingerprint, hashes, make_pool, new_metrics
from tests.support.kv_bytes import sample as tier_sample
from worker.tiers import KVLayout, LoadOutcome, PeerStore, StoreMover, StoreOpenError, open_store
from worker.tiers.entry import HEADER_BYTES
from worker.tiers.store import PEER_ROUTE

KEY = "group-key"


class Writer:
    """A writer's peer store behind a real HTTP server answering its peer route
    as the worker does (`worker/server/app.py`); `tamper` alters each answer."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.tamper = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != PEER_ROUTE or not outer.store.authorized(
                    self.headers.get("Authorization")
                ):
                    self.send_response(401)
                    self.end_headers()
                    return
                answer = outer.store.serve(body.decode().split("\n"))
                if outer.tamper is not None:
                    answer = outer.tamper(answer)
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.store = PeerStore(self.url, KEY, capacity)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def writer():
    w = Writer()
    yield w
    w.close()


def _reader(layout: KVLayout, key: str = KEY, seed: int = 1):
    pool = make_pool(torch.float16, seed=seed)  # the writers' dtype: one layout
    metrics = new_metrics()
    store = PeerStore("http://127.0.0.1:9/reader", key, 1 << 20)
    return pool, metrics, StoreMover(store, layout, pool, meter=metrics.tier("shared"))


def test_a_pulled_entry_comes_back_bit_for_bit(writer):
    pool = make_pool(torch.float16)
    layout = KVLayout.of_pool(pool, fingerprint())
    wmetrics = new_metrics()
    writer.store.on_served = wmetrics.tier("shared").served
    mine = StoreMover(writer.store, layout, pool)
    hs = hashes(3, layout.key)
    assert mine.save_blocks([2, 5, 7], hs) == [True] * 3
    rpool, metrics, reader = _reader(layout)
    unknown = hashes(1, "never saved")[0]
    got = reader.load_blocks([hs[1], unknown, hs[0]], [0, 1, 9], [writer.url] * 3)
    assert got == [LoadOutcome(True), LoadOutcome(False, "missing"), LoadOutcome(True)]
    assert block_bytes(rpool, 0) == block_bytes(pool, 5)
    assert block_bytes(rpool, 9) == block_bytes(pool, 2)
    assert tier_sample(metrics, "loaded_blocks_total", "shared") == 2
    assert tier_sample(wmetrics, "served_blocks_total", "shared") == 2
    # the writer's own loads read its memory, over no wire
    writer.close()
    assert mine.load_blocks([hs[2]], [0], [writer.url]) == [LoadOutcome(True)]


def test_an_altered_answer_is_refused_and_never_loaded(writer):
    pool = make_pool(torch.float16)
    layout = KVLayout.of_pool(pool, fingerprint())
    hs = hashes(2, layout.key)
    StoreMover(writer.store, layout, pool).save_blocks([1, 2], hs)

    def flip(answer: bytes) -> bytes:
        b = bytearray(answer)
        b[8 + HEADER_BYTES + 3] ^= 0x10  # a bit of the first entry's K
        return bytes(b)

    writer.tamper = flip
    rpool, metrics, reader = _reader(layout)
    before = block_bytes(rpool, 4)
    got = reader.load_blocks(hs, [4, 5], [writer.url] * 2)
    assert got == [LoadOutcome(False, "checksum"), LoadOutcome(True)]
    assert got[0].refused  # reported refused: the allocator drops the entry
    assert block_bytes(rpool, 4) == before
    assert block_bytes(rpool, 5) == block_bytes(pool, 2)
    assert tier_sample(metrics, "refused_entries_total", "shared", reason="checksum") == 1
    # an answer that is not the frames asked for: nothing of it is loaded
    writer.tamper = lambda answer: answer[:-1]
    assert (
        reader.load_blocks(hs, [4, 5], [writer.url] * 2) == [LoadOutcome(False, "unavailable")] * 2
    )
    assert block_bytes(rpool, 4) == before


def test_a_writer_that_does_not_answer_or_refuses_the_key_is_a_miss_not_a_refusal(writer):
    pool = make_pool(torch.float16)
    layout = KVLayout.of_pool(pool, fingerprint())
    hs = hashes(2, layout.key)
    StoreMover(writer.store, layout, pool).save_blocks([1, 2], hs)
    # another group's key: the writer answers 401
    _, _, stranger = _reader(layout, key="another-groups-key")
    assert (
        stranger.load_blocks(hs, [0, 1], [writer.url] * 2)
        == [LoadOutcome(False, "unavailable")] * 2
    )
    # one writer gone: its loads are misses, another writer's still load
    other = Writer()
    StoreMover(other.store, layout, pool).save_blocks([3], hashes(1, "other"))
    rpool, metrics, reader = _reader(layout)
    writer.close()
    got = reader.load_blocks([hs[0], hashes(1, "other")[0]], [0, 1], [writer.url, other.url])
    other.close()
    assert got == [LoadOutcome(False, "unavailable"), LoadOutcome(True)]
    assert not got[0].refused
    assert block_bytes(rpool, 1) == block_bytes(pool, 3)
    assert tier_sample(metrics, "store_errors_total", "shared") == 1
    assert reader.available  # one dead writer does not stop the loads from the others


class Silent:
    """A writer that takes connections and never answers (hung, or its host
    overloaded); `trickle`: it sends its answer's head, then a byte at a time,
    never all of it."""

    def __init__(self, trickle: bool = False) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        if trickle:
            threading.Thread(target=self._trickle, daemon=True).start()

    def _trickle(self) -> None:
        conn, _ = self.sock.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not self.stop.wait(0.05):
            conn.sendall(b"x")
        conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_a_step_waits_for_writers_that_do_not_answer_at_most_its_pull_timeout(writer):
    """The engine thread (every running sequence) waits for a step's pulls: at
    most the pull timeout for all writers together, however many hang or
    trickle, and not again for a writer that just did not answer."""
    pool = make_pool(torch.float16)
    layout = KVLayout.of_pool(pool, fingerprint())
    hs = hashes(4, layout.key)
    StoreMover(writer.store, layout, pool).save_blocks([1], hs[:1])
    hung = [Silent() for _ in range(3)]
    trickling = Silent(trickle=True)
    timeout = 0.3
    reader = StoreMover(
        PeerStore("http://127.0.0.1:9/reader", KEY, 1 << 20, timeout),
        layout,
        make_pool(torch.float16, seed=1),
        retry_interval_s=60,
    )

    def step(writers: list[str]) -> tuple[list[LoadOutcome], float]:
        t0 = time.monotonic()
        got = reader.load_blocks(hs[: len(writers)], list(range(len(writers))), writers)
        return got, time.monotonic() - t0

    try:
        unanswered = [LoadOutcome(False, "unavailable")]
        got, took = step([writer.url, hung[0].url])
        assert got == [LoadOutcome(True)] + unanswered  # a miss, not a refusal: computed
        assert took < 2 * timeout
        got, took = step([hung[0].url])  # not asked again: no wait
        assert got == unanswered and took < timeout / 3
        got, took = step([w.url for w in hung[1:]] + [trickling.url])
        assert got == unanswered * 3 and took < 2 * timeout  # not one timeout per writer
        got, took = step([trickling.url])  # its answer never whole: cut at the timeout
        assert got == unanswered and timeout / 2 < took < 2 * timeout
    finally:
        for w in (*hung, trickling):
            w.close()


def test_the_writers_memory_stays_within_the_stores_size():
    store = PeerStore("http://127.0.0.1:9", KEY, 10)
    for i in range(5):
        store.put(f"k-{i}", b"abcd")
    assert store.used_bytes == 8  # two entries of four bytes: the oldest went
    assert store.get_many(["k-0", "k-3", "k-4"]) == [None, b"abcd", b"abcd"]
    store.get("k-3")  # read: most recent
    store.put("k-5", b"abcd")
    assert store.get_many(["k-3", "k-4", "k-5"]) == [b"abcd", None, b"abcd"]
    store.put("big", b"x" * 11)  # larger than the store: never held
    assert store.get("big") is None and store.used_bytes == 8
    with pytest.raises(ValueError, match="1 to 4096 keys"):
        store.serve([])
    with pytest.raises(ValueError, match="a store key"):
        store.serve(["../x"])


def test_peer_urls_that_cannot_be_used_are_one_line_errors():
    for url, kw, pattern in (
        ("peer://somewhere", {}, "peer:// takes nothing after it"),
        ("peer:", {}, "unknown kind"),
        ("peer://", {}, "needs an advertised URL"),
        ("peer://", {"own_url": "http://w:8000", "peer_key": KEY}, "needs an advertised URL"),
    ):
        with pytest.raises(StoreOpenError, match=pattern) as err:
            open_store(url, **kw)
        assert "\n" not in str(err.value)
    store = open_store("peer://", own_url="http://w:8000", peer_key=KEY, capacity=100)
    assert isinstance(store, PeerStore)
    store.close()
