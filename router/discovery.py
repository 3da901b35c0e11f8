"""The live set of workers: learned from the allocator, or a static list.

- From the allocator: `ListPools` (every live pool, its advertised URL and
  model), listed again on every pool registered or dropped event, on a resync
  and every `refresh_s` seconds. The `WatchEvents` stream is reopened after
  any failure, with backoff, from the event after the last one seen.
- With a `PrefixView` the stream carries every event after a snapshot of every
  pool's cached blocks; each connection takes a new snapshot, and the view is
  not in step from a break until that snapshot ends (`router.prefix_view`).
- A listed pool is a candidate only once its worker has proven it
  (`prove`, `allocator_service.wire.attest`: `GET /pagedkv/identity` with a
  fresh nonce, answered with that pool and a proof under its attestation key),
  asked once per (pool, address) and again `RETRY_PROOF_S` after a failure.
- Static (`--workers`): exactly those URLs, trusted; with an allocator too,
  each is matched to the pool advertising it, for its cache view.
- Several allocators: one `Discovery` each; `MergedDiscovery` shows one set,
  each worker marked with the allocator holding its pool (`Worker.allocator`).

The reasons: docs/architecture.md, "A request, end to end".
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from allocator_service.wire.attest import IDENTITY_PATH, normalise_url, verify
from router.prefix_view import PrefixView

log = logging.getLogger(__name__)

# With a view: a stream in step this long before it broke or was told to
# resync starts its next connection at the shortest backoff again.
CALM_S = 10.0
# A worker's identity answer: how long to wait for it, the most bytes read of
# it, how soon a failed proof is asked again, and proofs asked at once.
PROOF_TIMEOUT_S = 2.0
MAX_PROOF_BYTES = 4096
RETRY_PROOF_S = 2.0
PROOF_THREADS = 8


@dataclass(frozen=True, slots=True)
class Worker:
    """A worker the router may send requests to."""

    url: str  # its HTTP API, no trailing '/'
    worker_id: str = ""
    pool_id: str = ""  # empty: no pool known (static, no allocator)
    model_fingerprint: str = ""
    served_model_name: str = ""  # empty: not known (static): any model
    num_blocks: int = 0
    block_size: int = 0
    free_blocks: int = 0
    # which of the router's allocators holds its pool (their order on the command line)
    allocator: int = 0
    # its pool has a host tier or uses the shared store (the view holds KV pools only)
    tiered: bool = False
    kv_role: str = "both"  # its part in prefill/decode disaggregation (router/pd.py)
    store_namespace: str = ""  # where its blocks live in the shared store ("" without it)

    @property
    def name(self) -> str:
        """What metrics and the `x-pagedkv-worker` header call it."""
        return self.worker_id or self.url


def prove(pool, timeout_s: float = PROOF_TIMEOUT_S) -> bool:
    """Whether the worker at `pool.advertise_url` proves it serves `pool`
    (a ListPools entry): a fresh nonce, and the answer checked against the
    pool's attestation key. Any failure (no key listed, refused, slow,
    oversized, wrong pool, wrong proof) is False."""
    key = getattr(pool, "attest_key", b"")
    url = normalise_url(pool.advertise_url)
    if not key or not url:
        return False
    nonce = secrets.token_hex(16)
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.stream(
            "GET",
            f"{url}{IDENTITY_PATH}",
            params={"nonce": nonce},
            timeout=timeout_s,
            follow_redirects=False,
        ) as r:
            if r.status_code != 200:
                return False
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_PROOF_BYTES or time.monotonic() > deadline:
                    return False
        answer = httpx.Response(200, content=body).json()
    except (httpx.HTTPError, ValueError):
        return False
    return verify(key, nonce, pool.pool_id, url, answer)


class Discovery:
    """The workers the router knows, kept current by a daemon thread."""

    def __init__(
        self,
        client=None,
        static: Sequence[str] = (),
        refresh_s: float = 5.0,
        on_change: Callable[[dict[str, Worker]], None] | None = None,
        index: int = 0,
        view: PrefixView | None = None,
    ) -> None:
        self.client = client  # a RouterClient, or None (static list only)
        # The pools' prefix caches from every block event (None: the pools' events only,
        # and the router asks MatchPrefix per request).
        self.view = view if client is not None else None
        self.index = index  # this allocator's place among the router's (`Worker.allocator`)
        self.static = [normalise_url(u) for u in static]
        self.refresh_s = refresh_s
        self.on_change = on_change
        self._workers: dict[str, Worker] = {u: Worker(u) for u in self.static}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stream = None
        self._thread: threading.Thread | None = None
        self._refresher: threading.Thread | None = None
        self.listed = threading.Event()  # the allocator answered at least once
        self._next_event = 0  # the event number to follow from on a reconnect (0: from now)
        self.refreshes = 0
        self.allocator_ok = client is None
        # (pool id, address) -> proven; a failed proof's next try (monotonic)
        self._proven: set[tuple[str, str]] = set()
        self._retry_at: dict[tuple[str, str], float] = {}
        self._prove_lock = threading.Lock()  # the two threads that list take turns proving
        self.unproven_pools = 0  # listed with an address, not proven (at the last listing)

    @property
    def workers(self) -> dict[str, Worker]:
        """url -> Worker, a snapshot."""
        return self._workers

    @property
    def parts(self) -> list[Discovery]:
        """The allocators followed, one Discovery each (`MergedDiscovery` has several)."""
        return [self] if self.client is not None else []

    @property
    def allocators_unreachable(self) -> int:
        return _unreachable(self.parts)

    def allocator_answers(self, index: int) -> bool:
        """Whether the allocator of `Worker.allocator == index` answered its last listing."""
        return self.allocator_ok

    def not_answering(self, index: int = 0) -> None:
        """A call to the allocator went unanswered: count it away until a listing succeeds."""
        if self.client is not None:
            self.allocator_ok = False

    def refresh(self) -> None:
        """List the allocator's pools now (raises what the client raises)."""
        pools = self.client.list_pools()
        proven = self._prove_new(
            [
                p
                for p in pools
                if normalise_url(p.advertise_url)
                and (not self.static or normalise_url(p.advertise_url) in self.static)
            ]
        )
        by_url: dict[str, Worker] = {}
        for p in pools:
            url = normalise_url(p.advertise_url)
            if (p.pool_id, url) not in proven:
                # not advertised, not among the static URLs, or its worker did not prove it
                continue
            w = Worker(
                url,
                p.worker_id,
                p.pool_id,
                p.model_fingerprint,
                p.served_model_name,
                p.num_blocks,
                p.block_size,
                p.free_blocks,
                self.index,
                bool(p.host_blocks or p.use_shared_store),
                p.kv_role or "both",
                p.store_namespace,
            )
            old = by_url.get(url)
            # Two live pools at one URL: a worker restarted under a new id while its
            # old pool's lease runs; the one with fewer blocks in use is the new one.
            if old is None or w.free_blocks > old.free_blocks:
                by_url[url] = w
        for url in self.static:
            by_url.setdefault(url, Worker(url, allocator=self.index))
        if self.view is not None:
            # a listing's free blocks, newer than the last event's for an idle pool
            for p in pools:
                self.view.note_free(p.pool_id, p.free_blocks)
        with self._lock:
            changed = set(by_url) != set(self._workers)
            self._workers = by_url
            self.refreshes += 1
        self.allocator_ok = True
        self.listed.set()
        if changed:
            log.info(
                "workers: %s",
                ", ".join(f"{w.name} at {u}" for u, w in sorted(by_url.items())) or "none",
            )
            if self.on_change is not None:
                self.on_change(by_url)

    def _prove_new(self, pools: list) -> set[tuple[str, str]]:
        """The (pool id, address) pairs of `pools` that are proven, asking
        each worker not yet proven (all at once) whose retry time has come."""
        with self._prove_lock:
            return self._prove_new_locked(pools)

    def _prove_new_locked(self, pools: list) -> set[tuple[str, str]]:
        now = time.monotonic()
        keys = {(p.pool_id, normalise_url(p.advertise_url)): p for p in pools}
        ask = [
            (k, p)
            for k, p in keys.items()
            if k not in self._proven and self._retry_at.get(k, 0.0) <= now
        ]
        if ask:
            with ThreadPoolExecutor(
                min(PROOF_THREADS, len(ask)), thread_name_prefix="router-prove"
            ) as ex:
                results = list(ex.map(lambda kp: prove(kp[1]), ask))
            for (key, _), ok in zip(ask, results, strict=True):
                if ok:
                    self._proven.add(key)
                    self._retry_at.pop(key, None)
                else:
                    if key not in self._retry_at:
                        log.warning(
                            "pool %s at %s: its worker did not prove it serves that pool; "
                            "not routed to",
                            *key,
                        )
                    self._retry_at[key] = now + RETRY_PROOF_S
        # forget pools no longer listed
        self._proven &= set(keys)
        self._retry_at = {k: t for k, t in self._retry_at.items() if k in keys}
        self.unproven_pools = len(keys) - len(self._proven)
        return set(self._proven)

    # ------------------------------------------------------------ threads
    def start(self) -> None:
        if self.client is None:
            self.listed.set()
            return
        self._thread = threading.Thread(target=self._follow, name="router-events", daemon=True)
        self._thread.start()
        self._refresher = threading.Thread(
            target=self._refresh_loop, name="router-refresh", daemon=True
        )
        self._refresher.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._try_refresh()

    def _try_refresh(self) -> bool:
        try:
            self.refresh()
            return True
        except Exception as exc:  # noqa: BLE001 - the allocator away: keep the last view, say so
            self.allocator_ok = False
            log.warning("cannot list the allocator's pools: %s", _short(exc))
            return False

    def _follow(self) -> None:
        from allocator_service.wire.v1 import allocator_pb2 as pb

        pool_kinds = (pb.KV_EVENT_KIND_POOL_REGISTERED, pb.KV_EVENT_KIND_POOL_DROPPED)
        view = self.view
        backoff = 0.1
        while not self._stop.is_set():
            in_step_since = None  # with a view: when its snapshot ended
            try:
                if view is not None:
                    # Every event, after a snapshot of the present: each (re)connection
                    # rebuilds the view (MatchPrefix answers until the snapshot ends).
                    view.begin()
                    self._stream = self.client.watch_events(snapshot=True, packed=True)
                else:
                    # Only the pools' events: a block's events (most of them, one per block
                    # hashed or evicted in any pool) would cost this process and the
                    # allocator CPU on every step for nothing this router uses. A
                    # reconnect follows on from the last event seen, so none is missed
                    # (too old: RESYNC_REQUIRED, answered by listing again).
                    self._stream = self.client.watch_events(
                        from_sequence=self._next_event, kinds=pool_kinds
                    )
                if self._stop.is_set():
                    break
                self._try_refresh()
                for event in self._stream:
                    kind = event.kind
                    if view is not None:
                        if kind == pb.KV_EVENT_KIND_RESYNC_REQUIRED:
                            # Events the view needs are gone: a new snapshot, after the backoff
                            # (at once, a router that cannot keep up would be sent snapshots back
                            # to back), which only a view in step a good while resets (below).
                            raise _Resync
                        view.apply(event)
                        if kind == pb.KV_EVENT_KIND_SNAPSHOT_END:
                            in_step_since = time.monotonic()
                        if kind not in pool_kinds:
                            continue
                    else:
                        backoff = 0.1
                        if kind != pb.KV_EVENT_KIND_RESYNC_REQUIRED:
                            self._next_event = event.sequence + 1
                    self._try_refresh()  # a pool came or went, or events were missed
            except _Resync:
                log.warning(
                    "allocator event stream: events were missed; a new snapshot in %.1f s", backoff
                )
                self._cancel_stream()
            except Exception as exc:  # noqa: BLE001 - reconnect after any failure
                if self._stop.is_set():
                    break
                log.warning(
                    "allocator event stream: %s; reconnecting in %.1f s", _short(exc), backoff
                )
            finally:
                if view is not None:
                    view.lost()
                    if in_step_since is not None and time.monotonic() - in_step_since > CALM_S:
                        backoff = 0.1  # a stream that served a good while: reconnect promptly
            if self._stop.wait(backoff):
                break
            backoff = min(backoff * 2, 2.0)

    def _cancel_stream(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def close(self) -> None:
        self._stop.set()
        self._cancel_stream()
        for t in (self._thread, self._refresher):
            if t is not None:
                t.join(timeout=2)


class MergedDiscovery:
    """Several allocators' workers as one set (the interface of `Discovery`).

    A URL listed by two allocators (a worker moved from one to another, its
    old pool's lease still running) is the entry of an allocator that
    answers its listings over one that does not (whose last listing may be
    stale), then a pool over a bare static entry, then the pool with more
    free blocks, as within one allocator."""

    def __init__(self, parts: Sequence[Discovery]) -> None:
        if not parts:
            raise ValueError("no allocator to follow")
        self.parts = list(parts)
        self._merged: dict[str, Worker] = {}
        # the parts' views (held: no id is reused) and answering flags merged last
        self._views: list[tuple[dict[str, Worker], bool]] = []

    @property
    def workers(self) -> dict[str, Worker]:
        # NOTE: each part replaces its whole dict when it lists again, so
        # identity says whether anything changed: a request merges only after a change.
        views = [(p.workers, p.allocator_ok) for p in self.parts]
        if len(views) != len(self._views) or any(
            a is not b or ok != was for (a, ok), (b, was) in zip(views, self._views, strict=False)
        ):
            merged: dict[str, Worker] = {}
            best: dict[str, tuple[bool, bool, int]] = {}
            for view, ok in views:
                for url, w in view.items():
                    rank = (ok, bool(w.pool_id), w.free_blocks)
                    if url not in best or rank > best[url]:
                        merged[url], best[url] = w, rank
            self._merged, self._views = merged, views
        return self._merged

    @property
    def unproven_pools(self) -> int:
        return sum(p.unproven_pools for p in self.parts)

    @property
    def allocator_ok(self) -> bool:
        """Every allocator answered its last listing."""
        return all(p.allocator_ok for p in self.parts)

    def allocator_answers(self, index: int) -> bool:
        return self.parts[index].allocator_ok

    def not_answering(self, index: int) -> None:
        self.parts[index].not_answering()

    @property
    def allocators_unreachable(self) -> int:
        return _unreachable(self.parts)

    def refresh(self) -> None:
        for p in self.parts:
            p.refresh()

    def start(self) -> None:
        for p in self.parts:
            p.start()

    def close(self) -> None:
        for p in self.parts:
            p.close()


class _Resync(Exception):
    """The allocator no longer holds events the view needs."""


def _unreachable(parts: Sequence[Discovery]) -> int:
    """How many of the followed allocators did not answer their last listing."""
    return sum(not p.allocator_ok for p in parts)


def _short(exc: BaseException) -> str:
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}"
