"""The playground's one call: run a list of operations (the trace format of
`pagedkv replay`) on a fresh pool of the real core, and the contiguous
baseline beside it, and describe where everything sits.

Stateless: the page keeps the list of what was clicked and sends it whole
with each action, so the server holds nothing per visitor and any state is
reproducible from its list (the article's table is eight lines of it).
"""

from __future__ import annotations

from typing import Any

from allocator_service.core import (
    Admit,
    Append,
    BlockPool,
    ContiguousPool,
    Fork,
    Free,
    InvalidArgument,
    Op,
    PoolConfig,
    execute_step,
)
from allocator_service.core.snapshot import pool_view
from allocator_service.core.validation import check_tokens

# Bounds on one request: a teaching pool, not a workload.
MAX_BLOCKS = 64
MAX_BLOCK_SIZE = 16
MAX_OPS = 500
MAX_TOKENS = 4096


class PlaygroundError(ValueError):
    """A request the playground refuses (HTTP 400)."""


def _name(obj: dict, key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > 32:
        raise PlaygroundError(f"{key} must be a name of 1 to 32 characters")
    return value


def _tokens(obj: dict) -> list[int]:
    tokens = obj.get("tokens")
    if not isinstance(tokens, list):
        raise PlaygroundError("tokens must be a list of token ids")
    try:
        check_tokens(tokens)
    except InvalidArgument:
        raise PlaygroundError("tokens must be a list of token ids") from None
    return tokens


def to_op(obj: Any) -> Op:
    if not isinstance(obj, dict):
        raise PlaygroundError("each operation is an object")
    kind = obj.get("op")
    if kind == "admit":
        return Admit(_name(obj, "seq"), _tokens(obj))
    if kind == "append":
        return Append(_name(obj, "seq"), _tokens(obj))
    if kind == "fork":
        return Fork(_name(obj, "parent"), _name(obj, "child"))
    if kind == "free":
        return Free(_name(obj, "seq"))
    raise PlaygroundError("op must be admit, append, fork or free")


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise PlaygroundError(f"{key} must be an integer from {lo} to {hi}")
    return value


class Contiguous:
    """The reserve-the-maximum layout over the same slots: each chat
    reserves `reserve` slots in a row when it arrives; one that does not
    fit waits (shut out) and is placed first-fit when slots come free."""

    def __init__(self, slots: int, reserve: int) -> None:
        self.pool = ContiguousPool(slots)
        self.reserve = reserve
        self.tokens: dict[str, int] = {}
        self.waiting: list[str] = []

    def _place(self, rid: str) -> bool:
        return self.pool.reserve(rid, self.reserve, min(self.tokens[rid], self.reserve)) is not None

    def apply(self, op: Op) -> None:
        if isinstance(op, Admit):
            if op.seq in self.tokens:
                return
            self.tokens[op.seq] = len(op.tokens)
            if not self._place(op.seq):
                self.waiting.append(op.seq)
        elif isinstance(op, Append) and op.seq in self.tokens:
            self.tokens[op.seq] += len(op.tokens)
            r = self.pool.requests.get(op.seq)
            if r is not None:
                r.used = min(self.tokens[op.seq], r.reserved)
        elif isinstance(op, Fork) and op.parent in self.tokens and op.child not in self.tokens:
            self.tokens[op.child] = self.tokens[op.parent]
            if not self._place(op.child):
                self.waiting.append(op.child)
        elif isinstance(op, Free) and op.seq in self.tokens:
            del self.tokens[op.seq]
            if op.seq in self.waiting:
                self.waiting.remove(op.seq)
            else:
                self.pool.free(op.seq)
                for rid in list(self.waiting):
                    if self._place(rid):
                        self.waiting.remove(rid)

    def view(self) -> dict[str, Any]:
        p = self.pool
        return {
            "slots": p.num_slots,
            "reserve": self.reserve,
            "requests": {
                rid: {
                    "start": r.start,
                    "reserved": r.reserved,
                    "used": r.used,
                    "tokens": self.tokens[rid],
                }
                for rid, r in p.requests.items()
            },
            "waiting": list(self.waiting),
            "used": p.used_slots,
            "wasted": p.reserved_slots - p.used_slots,
            "free": p.free_slots,
            "free_runs": p.free_runs(),
        }


def run(body: Any) -> dict[str, Any]:
    """`body`: {num_blocks, block_size, prefix_caching, reserve, ops}."""
    if not isinstance(body, dict):
        raise PlaygroundError("the body is a JSON object")
    num_blocks = _int(body, "num_blocks", 8, 1, MAX_BLOCKS)
    block_size = _int(body, "block_size", 4, 1, MAX_BLOCK_SIZE)
    reserve = _int(body, "reserve", 16, 1, num_blocks * block_size)
    caching = body.get("prefix_caching", False)
    if not isinstance(caching, bool):
        raise PlaygroundError("prefix_caching is true or false")
    raw = body.get("ops", [])
    if not isinstance(raw, list) or len(raw) > MAX_OPS:
        raise PlaygroundError(f"ops is a list of at most {MAX_OPS} operations")
    ops = [to_op(o) for o in raw]
    if sum(len(getattr(o, "tokens", ())) for o in ops) > MAX_TOKENS:
        raise PlaygroundError(f"at most {MAX_TOKENS} tokens in all")
    pool = BlockPool(PoolConfig(num_blocks, block_size, caching, "playground"))
    contiguous = Contiguous(num_blocks * block_size, reserve)
    results = []
    for op in ops:
        (r,) = execute_step(pool, [op])
        out: dict[str, Any] = {"ok": r.ok}
        if r.ok:
            contiguous.apply(op)
            cached = r.cached_tokens if isinstance(op, Admit) else 0
            out["new_blocks"] = (
                [] if isinstance(op, Fork) else list(r.append[cached // block_size :])
            )
            out["copies"] = [list(c) for c in r.copies]
            out["cached_tokens"] = cached
        else:
            out["error"], out["message"] = r.error, r.message
        # the columns `pagedkv replay` prints, and each chat's length
        out.update(pool_view(pool))
        out["tokens"] = {seq: pool.num_tokens(seq) for seq in out["tables"]}
        results.append(out)
    return {"results": results, "paged": paged_view(pool), "contiguous": contiguous.view()}


def paged_view(pool: BlockPool) -> dict[str, Any]:
    stats = pool.stats()
    view = pool_view(pool)
    hashes = pool.index.block_hash
    tables = view["tables"]
    fill = {}
    for seq_id, table in tables.items():
        n = pool.num_tokens(seq_id)
        for i, b in enumerate(table):
            fill.setdefault(b, min(pool.block_size, n - i * pool.block_size))
    free = view["free"]
    blocks = []
    for b in range(pool.num_blocks):
        owners = [s for s, t in tables.items() if b in t]
        state = "used" if owners else ("cached" if hashes[b] is not None else "free")
        blocks.append(
            {
                "id": b,
                "state": state,
                "owners": owners,
                "ref": pool.ref_cnt[b],
                "fill": fill.get(b, 0),
                "evict_rank": free.index(b) if state == "cached" else None,
            }
        )
    return {
        **view,
        "tokens": {s: pool.num_tokens(s) for s in tables},
        "blocks": blocks,
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "prefix_caching": pool.enable_prefix_caching,
        "used_blocks": stats.used_blocks,
        "cached_blocks": stats.cached_blocks,
        "free_blocks": stats.free_blocks,
        "used_slots": stats.tokens_stored,
        "wasted_slots": stats.wasted_slots,
        "hit_rate": stats.prefix_hit_rate,
    }
