"""`pagedkv replay`: run a JSON-lines trace of allocator operations and print
the pool's state after each one.

Trace lines (one operation each):
    {"op": "admit",  "seq": "A", "tokens": [...], "salt": "optional"}
    {"op": "append", "seq": "A", "tokens": [...]}
    {"op": "fork",   "parent": "S1", "child": "S2"}
    {"op": "free",   "seq": "B"}

Output: one JSON object per operation with `ok`, `error` (when not ok),
`cached_tokens` (admit), `new_blocks`, `copies`, `tables`, `free`,
`refcounts` and `wasted_slots`. A failed operation prints the unchanged state.

With `--allocator HOST:PORT` the trace runs against a running allocator
service (a fresh pool of the given shape) and prints the same lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from allocator_service.client import AllocatorClient, PoolSpec, connect
from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    Fork,
    Free,
    InvalidArgument,
    Op,
    PoolConfig,
)
from allocator_service.core.limits import MAX_TOKEN_ID
from allocator_service.core.snapshot import pool_view
from pagedkv_base.settings import CliError, read_secret

_FIELDS = {
    "admit": ({"seq", "tokens"}, {"salt"}),
    "append": ({"seq", "tokens"}, set()),
    "fork": ({"parent", "child"}, set()),
    "free": ({"seq"}, set()),
}


class TraceError(CliError):
    pass


def _is_token_list(v: object) -> bool:
    return isinstance(v, list) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in v)


def parse_op(line: str, lineno: int) -> Op:
    """One trace line -> an operation, or a TraceError naming the line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object")
    kind = obj.get("op")
    if kind not in _FIELDS:
        raise TraceError(
            f"line {lineno}: unknown op {kind!r} (expected one of {', '.join(_FIELDS)})"
        )
    required, optional = _FIELDS[kind]
    keys = set(obj) - {"op"}
    if missing := required - keys:
        raise TraceError(f"line {lineno}: {kind} needs {', '.join(sorted(missing))}")
    if extra := keys - required - optional:
        raise TraceError(f"line {lineno}: {kind} does not take {', '.join(sorted(extra))}")
    for name in ("seq", "parent", "child", "salt"):
        if name in obj and not (isinstance(obj[name], str) and obj[name]):
            raise TraceError(f"line {lineno}: {name} must be a non-empty string")
    if "tokens" in obj and not _is_token_list(obj["tokens"]):
        raise TraceError(f"line {lineno}: tokens must be a list of integers in [0, 2^32)")
    if kind == "admit":
        return Admit(obj["seq"], obj["tokens"], obj.get("salt"))
    if kind == "append":
        return Append(obj["seq"], obj["tokens"])
    if kind == "fork":
        return Fork(obj["parent"], obj["child"])
    return Free(obj["seq"])


def parse_trace(lines: Iterable[str]) -> list[Op]:
    """Parse the whole trace first, so a malformed line stops the replay
    before any operation has run."""
    ops = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            ops.append(parse_op(line, lineno))
    return ops


def replay_ops(ops: Iterable[Op], client: AllocatorClient) -> Iterator[dict[str, Any]]:
    block_size = client.spec.config.block_size
    for op in ops:
        (r,) = client.step([op])
        out: dict[str, Any] = {"ok": r.ok}
        if not r.ok:
            out["error"] = r.error
            out["message"] = r.message
        if isinstance(op, Admit) and r.ok:
            out["cached_tokens"] = r.cached_tokens
        # Admit's table change lists the cache hits (full blocks) too; only
        # blocks taken from the free queue are "new".
        new = r.append[r.cached_tokens // block_size :] if isinstance(op, Admit) else r.append
        out["new_blocks"] = [] if isinstance(op, Fork) or not r.ok else list(new)
        out["copies"] = [list(c) for c in r.copies]
        out.update(pool_view(BlockPool.from_state(client.dump())))
        yield out


def replay_lines(lines: Iterable[str], client: AllocatorClient) -> Iterator[dict[str, Any]]:
    return replay_ops(parse_trace(lines), client)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "replay",
        help="run a JSON-lines trace of allocator operations, print the state after each",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", metavar="TRACE", help="JSON-lines file of operations ('-' for stdin)")
    p.add_argument("--num-blocks", type=int, required=True, help="blocks in the pool")
    p.add_argument("--block-size", type=int, required=True, help="token slots per block")
    p.add_argument(
        "--prefix-caching", action="store_true", help="enable hash-chained prefix caching"
    )
    p.add_argument(
        "--allocator",
        default=None,
        metavar="HOST:PORT",
        help="run the trace against a running allocator service: register a fresh pool of "
        "this shape there (deregistered at the end) instead of using the core in-process",
    )
    p.add_argument(
        "--allocator-token-file",
        default=None,
        metavar="PATH",
        help="file holding the allocator's bearer token, when it requires one",
    )
    p.add_argument(
        "--allocator-tls-ca",
        default=None,
        metavar="PEM",
        help="CA certificate to verify the allocator's TLS certificate",
    )
    return p


def run(args: argparse.Namespace) -> int:
    try:
        fh = sys.stdin if args.trace == "-" else open(args.trace, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise CliError(f"cannot read {args.trace}: {exc.strerror}") from None
    with fh:
        ops = parse_trace(fh)
    client = make_client(args)
    try:
        for out in replay_ops(ops, client):
            print(json.dumps(out), flush=True)
    finally:
        client.close()
    return 0


def make_client(args: argparse.Namespace) -> AllocatorClient:
    """A fresh pool of the given shape: in this process, or at the
    allocator service with `--allocator` (deregistered on close)."""
    import os
    import uuid

    try:
        spec = PoolSpec(
            f"replay-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            PoolConfig(
                num_blocks=args.num_blocks,
                block_size=args.block_size,
                enable_prefix_caching=args.prefix_caching,
            ),
        )
    except InvalidArgument as exc:
        raise CliError(str(exc)) from None
    if not getattr(args, "allocator", None):
        return connect("embedded", spec)

    import grpc

    from allocator_service.client import AllocatorUnavailable

    token = (
        read_secret(args.allocator_token_file, "allocator token file")
        if args.allocator_token_file
        else None
    )
    try:
        return connect(
            args.allocator, spec, auth_token=token, tls_ca=args.allocator_tls_ca, retries=3
        )
    except AllocatorUnavailable as exc:
        raise CliError(f"cannot reach the allocator at {args.allocator}: {exc}") from None
    except grpc.RpcError as exc:
        raise CliError(
            f"the allocator refused the pool: {exc.code().name}: {exc.details()}"
        ) from None
