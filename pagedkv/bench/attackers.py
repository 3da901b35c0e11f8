"""The attacks of the trust-boundary drills, each written once: the tests
(tests/router/test_trust.py, tests/router/test_failover.py, tests/router/test_api_key_salts.py,
tests/web/test_http_port_bounds.py, tests/allocator/test_slow_read_flood.py,
tests/drills/test_time_isolation.py) and `pagedkv bench attacks` run them.

- `Attacker`: an HTTP server that answers completions with its own text and
  records every request (and Authorization header) it is sent; its identity
  route relays a real worker's answer or forges one. `rogue_pool` registers
  a pool advertising an address under a model's name.
- `connect`, `idle_connections`, `read_to_close`, `slow_clients`: raw
  connections that send nothing, or a request's head or body that never ends.
- `big_text`: a text of about N bytes for /tokenize and prompts.
- `slow_read_flood`: many large pools keeping far more integrity checks in
  flight than their slots allow (run it in a process of its own).
- `snapshot_amplifier`: a legal pool whose snapshot is as large as its shape
  allows (forks with the longest ids).
- `SnapshotWatchers`: `WatchEvents` streams that each ask for the snapshot
  of every pool's cached blocks and read it slowly.
- `PublicModel`, `plant_entries`, `overwrite_entries`, `read_entries`: the
  shared store against a worker of another group and whoever reads or writes
  its files: forged K/V under a valid header and checksum, planted through
  the protocol or written over existing entries, and entries read back into
  prompt tokens (layer 0's V of a token depends on the token alone, so the
  public weights map each V row back to its token).
- `BadWorker`: a loopback server speaking just enough HTTP/1.1 to fail a
  router in one chosen way (refuse, drop, stay silent, answer without end,
  trickle), and, given a pool's proof, to pass for that pool's worker.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx

from allocator_service.client import PoolSpec
from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit, Fork, PoolConfig
from allocator_service.wire.attest import IDENTITY_PATH
from allocator_service.wire.codec import encode_ops
from allocator_service.wire.v1 import allocator_pb2 as pb
from allocator_service.wire.v1 import allocator_pb2_grpc as pb_grpc
from pagedkv_base.api.serving import raise_open_files_limit

PWNED = "pwned"  # the text the attacker answers every completion with


class Attacker:
    """An HTTP server that answers completions with its own text and records
    every request and Authorization header it is sent. Its identity route
    relays what the real worker at `relay` answers (a real proof, for the
    real worker's pool), or, without `relay`, a forged proof for `pool_id`."""

    def __init__(self, model: str, relay: str | None = None) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        self.relay, self.pool_id = relay, ""
        attacker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                attacker.requests.append(("GET", self.path, self.headers.get("authorization")))
                if self.path.startswith("/pagedkv/identity"):
                    if attacker.relay:
                        r = httpx.get(attacker.relay + self.path, timeout=5)
                        return self._answer(r.status_code, r.json())
                    return self._answer(
                        200, {"pool_id": attacker.pool_id, "worker_id": "evil", "proof": "0" * 64}
                    )
                if self.path.startswith("/health"):
                    return self._answer(200, {"status": "ok"})
                self._answer(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                attacker.requests.append(("POST", self.path, self.headers.get("authorization")))
                self._answer(
                    200,
                    {
                        "id": "cmpl-evil",
                        "object": "text_completion",
                        "created": 0,
                        "model": model,
                        "choices": [
                            {"index": 0, "text": PWNED, "finish_reason": "stop", "logprobs": None}
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def posts(self) -> int:
        return sum(m == "POST" for m, _, _ in self.requests)

    @property
    def credentials_seen(self) -> int:
        """Requests that carried an Authorization header (a user's key, or the router's)."""
        return sum(auth is not None for _, _, auth in self.requests)


def rogue_pool(
    address: str, worker_id: str, url: str, model: str, token: str | None
) -> GrpcAllocator:
    """A pool registered as `worker_id`, advertising `url` under
    `model` (raises grpc.RpcError if refused)."""
    spec = PoolSpec(
        worker_id,
        PoolConfig(4096, 16, True, "attacker"),
        advertise_url=url,
        served_model_name=model,
    )
    return GrpcAllocator(address, spec, auth_token=token, retries=0, register_wait_s=0)


# -- connections that never finish --------------------------------------------------------

SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"  # never ends its head
# never ends its body
SLOW_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 1000\r\n\r\n{"
)


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to an http://HOST:PORT[/...] address."""
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


FILES_BESIDE = 256  # descriptors this process keeps for everything but the idle connections


class TooFewFiles(OSError):
    """This process may not open that many connections (its open-file limit)."""


def idle_connections(url: str, n: int, timeout: float = 10.0) -> list[socket.socket]:
    """`n` connections to `url` that send nothing, this process's open-file
    limit raised to hold them first (`TooFewFiles` if its hard limit is too low)."""
    limit = raise_open_files_limit()
    if limit < n + FILES_BESIDE:
        raise TooFewFiles(
            f"{n} idle connections need an open-file limit of {n + FILES_BESIDE}; "
            f"this process's is {limit} (ulimit -n)"
        )
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(connect(url, timeout))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def read_to_close(sock: socket.socket) -> None:
    """Returns once the other end closes (socket.timeout if it
    does not within the socket's timeout)."""
    while sock.recv(65536):
        pass


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed (or reset) the connection; never waits."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def slow_clients(
    url: str, heads: int, bodies: int
) -> tuple[list[socket.socket], list[socket.socket]]:
    """`heads` connections that send part of a request's head and `bodies`
    that send a head and part of its body, then nothing more."""
    h = [connect(url) for _ in range(heads)]
    for sock in h:
        sock.sendall(SLOW_HEAD)
    b = [connect(url) for _ in range(bodies)]
    for sock in b:
        sock.sendall(SLOW_BODY)
    return h, b


def big_text(nbytes: int) -> str:
    """About `nbytes` of plain words."""
    return "hello paged world, " * (nbytes // 19)


# -- the allocator: many pools' slow reads --------------------------------------------------


def slow_read_flood(
    address: str,
    stop,
    ready,
    *,
    pools: int = 12,
    in_flight: int = 24,
    blocks: int = 32768,
    tokens: int = 16384,
    token: str | None = None,
    outcome=None,
) -> None:
    """Register `pools` large pools, fill each with `tokens` tokens, then keep
    `in_flight` integrity checks of each in flight until `stop` (answers and
    refusals alike are sent again at once); `ready` once they are. `outcome`
    (a queue) gets {"registered": n, "codes": {code: n}} at the end: the
    registrations refused and the checks' answers."""
    channel = grpc.insecure_channel(address)
    s = pb_grpc.AllocatorStub(channel)
    md = (("authorization", f"Bearer {token}"),) if token else None
    codes: Counter[str] = Counter()
    lock = threading.Lock()
    refs = []
    try:
        for i in range(pools):
            shape = pb.PoolShape(
                num_blocks=blocks, block_size=16, model_fingerprint="m", enable_prefix_caching=True
            )
            r = s.RegisterPool(
                pb.RegisterPoolRequest(worker_id=f"flood-{i}", shape=shape), metadata=md, timeout=10
            )
            ref = pb.PoolRef(pool_id=r.pool_id, credential=r.credential)
            s.Step(
                pb.StepRequest(
                    pool=ref, step_id=1, ops=encode_ops([Admit("a", list(range(1, tokens + 1)))])
                ),
                metadata=md,
                timeout=60,
            )
            refs.append(ref)
    except grpc.RpcError as err:
        codes[f"RegisterPool {err.code().name}"] += 1

    def again(ref):
        def send(done=None):
            if done is not None:
                code = done.code()
                with lock:
                    codes[code.name if code is not None else "CANCELLED"] += 1
            if not stop.is_set():
                s.GetPoolStats.future(
                    pb.GetPoolStatsRequest(pool=ref, check_integrity=True), metadata=md, timeout=60
                ).add_done_callback(send)

        return send

    for ref in refs:
        for _ in range(in_flight):
            again(ref)()
    ready.set()
    stop.wait(600)
    time.sleep(0.5)  # the last answers' callbacks
    channel.close()
    if outcome is not None:
        with lock:
            outcome.put({"registered": len(refs), "codes": dict(codes)})


# -- the allocator: a pool whose snapshot is as large as it can be --------------------------


def snapshot_amplifier(
    address: str,
    token: str | None = None,
    *,
    blocks: int = 2048,
    block_size: int = 4,
    prompt_tokens: int = 8,
    steps: int = 8,
    forks: int = 500,
    id_chars: int = 256,
    seed: int = 4,
) -> tuple[GrpcAllocator, Counter]:
    """A legal pool of `blocks` blocks: one sequence with an id of `id_chars`
    characters and `prompt_tokens` tokens, then `steps` steps of `forks` forks
    of it, each with an id of `id_chars` characters (in steps whose answers
    fit a message). The client, and its operations' outcomes ("ok" or the
    error's name); grpc.RpcError if the pool is refused."""
    pool = GrpcAllocator(
        address,
        PoolSpec("snapshot-amplifier", PoolConfig(blocks, block_size, True, "m")),
        auth_token=token,
    )
    parent = "x" * id_chars
    outcomes: Counter[str] = Counter()
    for r in pool.step([Admit(parent, list(range(prompt_tokens)))]):
        outcomes["ok" if r.ok else str(r.error)] += 1
    names = random.Random(seed)
    for _ in range(steps):
        for r in pool.step(
            [Fork(parent, names.randbytes(id_chars // 2).hex()) for _ in range(forks)]
        ):
            outcomes["ok" if r.ok else str(r.error)] += 1
    return pool, outcomes


# -- the allocator: snapshot watchers ----------------------------------------------------------


class SnapshotWatchers:
    """`n` WatchEvents streams, each asking for the snapshot of every pool's
    cached blocks and reading a message every `pause_s`, until `stop()`:
    then their messages read and how each ended, by code."""

    def __init__(
        self, address: str, n: int, token: str | None = None, pause_s: float = 0.05
    ) -> None:
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", -1)]
        )
        self._stub = pb_grpc.AllocatorStub(self._channel)
        self._md = (("authorization", f"Bearer {token}"),) if token else None
        self._pause_s = pause_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._streams: list = []
        self.messages = 0
        self.snapshots_ended = 0
        self.codes: Counter[str] = Counter()
        self._threads = [
            threading.Thread(target=self._watch, daemon=True, name=f"watcher-{i}") for i in range(n)
        ]

    def start(self) -> SnapshotWatchers:
        for t in self._threads:
            t.start()
        return self

    def _watch(self) -> None:
        stream = self._stub.WatchEvents(
            pb.WatchEventsRequest(snapshot=True), metadata=self._md, timeout=600
        )
        with self._lock:
            self._streams.append(stream)
        code = "OK"
        try:
            for event in stream:
                with self._lock:
                    self.messages += 1
                    self.snapshots_ended += event.kind == pb.KV_EVENT_KIND_SNAPSHOT_END
                if self._stop.wait(self._pause_s):
                    break
        except grpc.RpcError as err:
            code = err.code().name
        with self._lock:
            self.codes[code if not self._stop.is_set() or code != "CANCELLED" else "OK"] += 1

    def stop(self) -> dict:
        self._stop.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        for t in self._threads:
            t.join(30)
        self._channel.close()
        return {
            "messages": self.messages,
            "snapshots_ended": self.snapshots_ended,
            "codes": dict(self.codes),
        }


# -- the shared KV store: forged entries and prompts read back -------------------------------------


class PublicModel:
    """What anyone can compute from a public model (`model`, loaded on the CPU as a
    worker loads it): its fingerprint, the KV layout of a worker's pool of it with
    `block_size`, and each vocabulary token's layer-0 V (`values`, [vocab, kv heads
    x head dim]): K carries its position (RoPE), V does not."""

    def __init__(self, model: str, block_size: int) -> None:
        import torch

        from worker.model.loader import load_model
        from worker.tiers import KVLayout

        self.loaded = load_model(model)
        c, m = self.loaded.config, self.loaded.model
        self.layout = KVLayout(
            self.loaded.fingerprint,
            block_size,
            str(m.dtype).removeprefix("torch."),
            c.num_kv_heads,
            c.head_dim,
            c.num_layers,
        )
        with torch.inference_mode():
            layer = m.model.layers[0]
            _, _, v = layer.self_attn.qkv_proj(
                layer.input_layernorm(m.model.embed_tokens.weight)
            ).split(layer.self_attn.split, dim=-1)
        self.values = v.float()

    def forged_block(self, seed: int) -> bytes:
        """One block's payload of made-up K/V (normal values of about the size of real ones)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        kv = torch.randn(self.layout.block_shape, generator=gen) * 1.5
        return kv.to(self.layout.torch_dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def tokens_of(self, payload: bytes, tolerance: float = 1e-3) -> list[int | None]:
        """The token at each position of one block's payload whose layer-0 V it holds
        (None where no token's V is within `tolerance`, relatively: not a real block)."""
        import torch

        kv = torch.frombuffer(bytearray(payload), dtype=self.layout.torch_dtype).view(
            self.layout.block_shape
        )
        # V, layer 0: [positions, heads x dim]
        rows = kv[1, 0].reshape(self.layout.block_size, -1).float()
        dist = torch.cdist(rows, self.values)
        best, token = dist.min(dim=1)
        scale = self.values.norm(dim=1)[token] + 1.0
        return [
            int(t) if d <= tolerance * s else None
            for d, t, s in zip(best, token, scale, strict=True)
        ]


def plant_entries(pool: GrpcAllocator, prompts: list[list[int]], model: PublicModel, store) -> int:
    """A worker's own pool poisoning the store through the protocol: for each
    prompt (token ids others will send) admit it, free it (the allocator asks
    for its full blocks to be written through to the store), write forged K/V
    under a valid header (and checksum) for each, and confirm the saves. The
    entries confirmed (findable by every pool of the pool's store namespace)."""
    from allocator_service.core import Free
    from allocator_service.core.tiers import TierReport
    from worker.tiers import encode_entry, entry_key

    planted = 0
    for i, tokens in enumerate(prompts):
        if not pool.step([Admit(f"bait-{i}", tokens)]).all_ok:
            continue
        saves = list(pool.step([Free(f"bait-{i}")]).moves.store_saves)
        store.put_many(
            [
                (
                    entry_key(pool.store_namespace, h),
                    encode_entry(model.layout, h, model.forged_block(planted + j)),
                )
                for j, h in enumerate(saves)
            ]
        )
        pool.step([], TierReport([], [], saves, [], []))
        planted += len(saves)
    return planted


def store_entries(root) -> list[tuple[object, str, bytes]]:
    """Every entry file of a file:// store's folder: (path, its store namespace, block hash)."""
    from pathlib import Path

    found = []
    for path in sorted(Path(root).rglob("*")):
        namespace, dash, hex_hash = path.name.rpartition("-")
        if path.is_file() and dash and not path.name.startswith(".") and len(hex_hash) == 64:
            found.append((path, namespace, bytes.fromhex(hex_hash)))
    return found


def overwrite_entries(root, model: PublicModel) -> int:
    """Whoever can write a file:// store's folder: every entry replaced by forged
    K/V under a valid header and checksum (plain: without a group's key nothing
    else can be written). The entries overwritten."""
    from worker.tiers import encode_entry

    entries = store_entries(root)
    for i, (path, _, block_hash) in enumerate(entries):
        path.write_bytes(encode_entry(model.layout, block_hash, model.forged_block(10_000 + i)))
    return len(entries)


def read_entries(root, model: PublicModel, seal=None) -> dict:
    """Whoever can read a file:// store's folder: each entry decoded (without a
    key, or with `seal`, a group's `StoreSeal`) and, where it opens, its tokens
    recovered from layer 0's V (`PublicModel.tokens_of`). {"entries": read,
    "decoded": opened, "refused": {reason: n}, "tokens": recovered, "blocks":
    the token ids of each entry every position of which was recovered}."""
    from worker.tiers import Refused, decode_entry

    refused: Counter[str] = Counter()
    decoded, tokens, blocks = 0, 0, []
    entries = store_entries(root)
    for path, namespace, block_hash in entries:
        got = decode_entry(
            path.read_bytes(), model.layout, block_hash, seal=seal, namespace=namespace
        )
        if isinstance(got, Refused):
            refused[got.reason] += 1
            continue
        decoded += 1
        ids = model.tokens_of(bytes(got))
        tokens += sum(t is not None for t in ids)
        if all(t is not None for t in ids):
            blocks.append(ids)
    return {
        "entries": len(entries),
        "decoded": decoded,
        "refused": dict(refused),
        "tokens": tokens,
        "blocks": blocks,
    }


def text_read_back(blocks: list[list[int]], tokenizer, secret: str) -> bool:
    """Whether `secret` (shorter than a block) is in the text of one recovered
    block or of two in a row (the order of blocks is not known: every pair)."""
    texts = [tokenizer.decode(b) for b in blocks]
    return any(secret in t for t in texts) or any(secret in a + b for a in texts for b in texts)


# -- a worker that fails the router on the wire -------------------------------------------------

BAD_MODES = (
    "503",
    "drop-body",
    "drop-stream",
    "silent",
    "huge",
    "huge-declared",
    "trickle",
    "trickle-stream",
    "record",
)
HUGE_BYTES = 300 << 20


class BadWorker:
    """An HTTP server on 127.0.0.1 that fails every POST in one way:
    `503` (answers Service Unavailable), `drop-body` (sends a 200 whose
    declared body never fully arrives), `drop-stream` (sends one SSE event,
    then closes), `silent` (reads the request and never answers), `huge` (a 200 whose
    body goes on for `huge_bytes`), `huge-declared` (a 200 that says its body is `huge_bytes`),
    `trickle` (a 200 whose body comes a byte at a time), `trickle-stream` (an event
    stream that sends a byte at a time and never ends an event), `record` (answers a
    completion and keeps each request's headers in `heads`); mode `by-prompt`: each
    request's prompt names its mode. `GET /pagedkv/identity?nonce=N` answers what
    `identity(N)` returns (a pool's proof, e.g. `GrpcAllocator.identity`) when it is
    set; other GETs answer 404. `sock`: a listening socket to serve on (its own, from
    the caller, e.g. for an address bound to a worker token), else a free port;
    `model`: the model its answers name."""

    def __init__(
        self,
        mode: str,
        *,
        sock: socket.socket | None = None,
        huge_bytes: int = HUGE_BYTES,
        identity: Callable[[str], dict | None] | None = None,
        model: str = "tiny-random",
    ) -> None:
        if mode not in (*BAD_MODES, "by-prompt"):
            raise ValueError(
                f"mode must be one of {', '.join(BAD_MODES)} or by-prompt, not {mode!r}"
            )
        self.mode = mode
        self.model = model
        self.sock = sock
        self.huge_bytes = huge_bytes
        self.identity = identity
        self.posts = 0
        self.heads: list[dict[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BadWorker:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the bad worker did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        where = {"sock": self.sock} if self.sock is not None else {"host": "127.0.0.1", "port": 0}
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, **where))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self.loop)  # answers still being sent: ended, not left pending
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    def _mode_of(self, body: bytes) -> str:
        if self.mode != "by-prompt":
            return self.mode
        try:
            mode = json.loads(body).get("prompt")
        except (ValueError, AttributeError):
            mode = None
        return mode if mode in BAD_MODES else "503"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next(
                (
                    int(v)
                    for k, _, v in (h.partition(":") for h in lines[1:])
                    if k.strip().lower() == "content-length"
                ),
                0,
            )
            body = await reader.readexactly(length)
            if not lines[0].startswith("POST"):
                target = lines[0].split(" ")[1] if lines[0].count(" ") >= 2 else ""
                path, _, query = target.partition("?")
                if path == IDENTITY_PATH and self.identity is not None:
                    nonce = next(
                        (
                            v
                            for k, _, v in (q.partition("=") for q in query.split("&"))
                            if k == "nonce"
                        ),
                        "",
                    )
                    answer = json.dumps(self.identity(nonce)).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer)
                    )
                else:
                    writer.write(
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    )
                return
            self.posts += 1
            self.heads.append(
                {
                    k.strip().lower(): v.strip()
                    for k, _, v in (h.partition(":") for h in lines[1:] if h)
                }
            )
            mode = self._mode_of(body)
            if mode == "record":
                answer = json.dumps(
                    {
                        "id": "cmpl-rec",
                        "object": "text_completion",
                        "created": 0,
                        "model": self.model,
                        "choices": [
                            {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (len(answer), answer)
                )
            elif mode == "503":
                answer = b'{"error": {"message": "overloaded"}}'
                writer.write(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer)
                )
            elif mode == "silent":  # takes the request and computes "forever"
                await reader.read()
            elif mode in ("huge", "huge-declared"):
                declared = (
                    b"content-length: %d\r\n" % self.huge_bytes if mode == "huge-declared" else b""
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + declared + b"\r\n"
                )
                block = b" " * (1 << 20)
                for _ in range(self.huge_bytes >> 20):
                    # until the router stops reading (its bound) or all is sent
                    writer.write(block)
                    await writer.drain()
            elif mode in ("trickle", "trickle-stream"):
                kind = b"text/event-stream" if mode == "trickle-stream" else b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: 100000\r\n\r\n" % kind
                )
                for _ in range(100000):
                    writer.write(b"d")
                    await writer.drain()
                    await asyncio.sleep(0.1)
            elif mode == "drop-body":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 500\r\n\r\n"
                    b'{"id": "cmpl-cut", "choices": ['
                )
            else:  # drop-stream
                event = {
                    "id": "cmpl-cut",
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [
                        {"index": 0, "text": "partial", "logprobs": None, "finish_reason": None}
                    ],
                }
                chunk = f"data: {json.dumps(event)}\n\n".encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(chunk), chunk)
                )
                # Dies a while after its first event, as a worker would; bytes that come
                # in the same read as the loss of the connection are not passed on (the
                # client library raises before it hands over what it buffered).
                await writer.drain()
                await asyncio.sleep(0.3)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            # (cancelled: the server stops; Python 3.11's stream callback fails on a cancelled task)
            pass
        finally:
            writer.close()
