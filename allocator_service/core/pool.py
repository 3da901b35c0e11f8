"""One worker's block pool: free queue, block tables, refcounts, prefix cache.

Invariants (checked by `integrity_problems()`):
- every block is in exactly one place: in use (refcount > 0), in the uncached
  free queue, or in the cached free queue;
- a block's refcount equals the number of block tables that name it;
- tables only grow, except that copy-on-write replaces the LAST entry and
  `unreserve` drops trailing blocks holding only reserved slots;
- `_fill[b]` (token slots of block `b` holding a token) equals every sharer's
  count of tokens in it: a shared block is never written (copied first);
- every hash in the index names blocks that hold exactly it; only full blocks
  get a hash;
- with tiers, the host tier's and the store's invariants (`tiers.py`) hold.

Hand-out order: uncached free blocks as freed (table order within one free;
0..N-1 at start), then cached ones least recently freed first, a sequence's
tail before its head. Every public mutating method succeeds whole or raises
an `AllocatorError` having changed nothing. The reasons: docs/architecture.md,
"The block contract".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mypy_extensions import mypyc_attr

from allocator_service.core import hashing
from allocator_service.core.block_hashes import NO_HASH
from allocator_service.core.errors import (
    InvalidArgument,
    OutOfBlocks,
    PoolLimit,
    SequenceExists,
    UnknownSequence,
)
from allocator_service.core.holdings import PoolHoldings
from allocator_service.core.limits import (
    MAX_RESERVE,
    MIN_NAME_CHARS,
    MIN_SEQUENCES,
    MIN_TABLE_ENTRIES,
    NAME_CHARS_PER_BLOCK,
    SEQUENCES_PER_BLOCK,
    TABLE_ENTRIES_PER_BLOCK,
)
from allocator_service.core.planner import (
    admit_blocks,
    after_append,
    after_unreserve,
    append_blocks,
    append_slots,
    release,
    unreserve_keep,
)
from allocator_service.core.sequence import SeqEntry
from allocator_service.core.tiers import NO_MOVES, Moves
from allocator_service.core.validation import (
    check_cache_salt,
    check_seq_id,
    check_tokens,
)


class AdmitResult(NamedTuple):
    cached_tokens: int  # leading prompt tokens found cached (in the KV pool or loaded from a tier)
    # tokens the sequence holds with their values after the admit (its reserved slots follow)
    num_stored: int
    # blocks taken for the tokens past the cached ones (and reserved slots), in table order
    new_blocks: list[int]
    table: list[int]  # the whole new block table (cached hits first)


class AppendResult(NamedTuple):
    keep: int  # entries of the old table kept as they are
    new_blocks: list[int]  # appended after the kept prefix, in order
    copies: list[tuple[int, int]]  # (src, dst) block copies to perform first


def _name_chars(seq_id: str, salt: str | None) -> int:
    """What a sequence's names count against `max_name_chars`."""
    return len(seq_id) + (len(salt) if salt else 0)


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockPool(PoolHoldings):
    """Block allocator for one worker's KV pool: every change to what it
    holds (`PoolHoldings`). Callers serialise access (the service holds one
    lock per pool).

    A pool that uses the shared store is given it here (`store`); several
    pools share one `SharedStore`, and their steps must then be applied in
    one order (the journal's). With tiers, the methods that evict or admit
    issue moves (saves, loads, store deletes) that accumulate until
    `take_moves` (what `run_step` returns in its answer)."""

    # ------------------------------------------------------------- mutations
    def admit(
        self,
        seq_id: str,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        num_new_tokens: object = None,
        reserve: object = 0,
        *,
        checked: bool = False,
    ) -> AdmitResult:
        """Create a sequence holding `tokens` (its prompt) and `reserve` slots
        after the tokens it stores, filled first by its next appends.

        With prefix caching the longest chain of cached full blocks is shared,
        never the block of the last prompt token. Each block of the chain is
        looked up in the KV pool, then the host tier, then the store, up to
        the first in none; a tier hit takes a fresh block, hashed at once, and
        issues its load. `cached_tokens` counts every block of the chain
        (shared or loaded: docs/architecture.md, "Tiers", "Counts");
        `num_new_tokens` bounds the tokens stored past it (chunked prefill).
        `checked`: the caller found every token valid (`tokens_ok`) already.
        """
        check_seq_id(seq_id)
        if seq_id in self._seqs:
            raise SequenceExists(seq_id)
        if not checked:
            check_tokens(tokens)
        check_cache_salt(cache_salt)
        names = _name_chars(seq_id, cache_salt)
        self._check_new_sequence(names)
        if num_new_tokens is not None and (
            not isinstance(num_new_tokens, int) or num_new_tokens < 1
        ):
            raise InvalidArgument("num_new_tokens must be a positive integer")
        if type(reserve) is not int or not 0 <= reserve <= MAX_RESERVE:
            raise InvalidArgument(f"reserve must be an integer in [0, {MAX_RESERVE}]")
        B = self.block_size
        n = len(tokens)

        hashes: list[bytes] = []
        # Per cached block of the prompt, first first: the KV block it shares,
        # or -tier (tiers.HOST, tiers.STORE): loaded from that tier into a
        # fresh block.
        hits: list[int] = []
        loads = 0
        if self.enable_prefix_caching:
            hashes = hashing.chain_hashes(self.root_hash, tokens, B, cache_salt)
            tiers = self.tiers
            for h in hashes[: max(n - 1, 0) // B]:
                b = self.index.pick(h, self.ref_cnt, self._stamp)
                if b is None:
                    if tiers is None or (t := tiers.find(h)) is None:
                        break
                    b = -t
                    loads += 1
                hits.append(b)
        cached = len(hits) * B
        stored, need = admit_blocks(n, len(hits), num_new_tokens, B, reserve)
        free_hits = sum(1 for b in hits if b >= 0 and self.ref_cnt[b] == 0)
        available = self.num_free_blocks - free_hits
        if need + loads > available:
            self.out_of_blocks += 1
            raise OutOfBlocks(need + loads, available)
        self._check_new_entries(len(hits) + need)

        # Commit: nothing below can fail.
        for b in hits:
            if b >= 0:
                if self.ref_cnt[b] == 0:
                    del self._cached_free[b]
                self.ref_cnt[b] += 1
        if loads:
            self._load(hits, hashes)
        new_blocks = self._take_run(need)
        if new_blocks:  # each full but the last, which holds the rest
            fill = self._fill
            for b in new_blocks:
                fill[b] = B
            fill[new_blocks[-1]] = stored + reserve - (len(hits) + need - 1) * B
        table = hits + new_blocks
        self.table_entries += len(table)
        self.name_chars += names
        seq = SeqEntry(table=table, num_tokens=stored + reserve, salt=cache_salt, reserved=reserve)
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += n
            self.prefix_hit_tokens += cached
            full = stored // B
            if full > len(hits):
                self.index.register_run(table[len(hits) : full], hashes[len(hits) : full])
            seq.num_hashed = full
            seq.tail = list(tokens[full * B : stored])
        self._seqs[seq_id] = seq
        return AdmitResult(cached, stored, new_blocks, list(table))

    def append(
        self, seq_id: str, tokens: Sequence[int], reserve: object = 0, *, checked: bool = False
    ) -> AppendResult:
        """Store `tokens` after the sequence's last known token (decode, or the
        next chunk of a chunked prefill), then hold `reserve` more slots for
        tokens whose values are not known yet (async scheduling: the slot of a
        token the worker is still sampling).

        `tokens` first fill the slots reserved earlier, in order (no new
        block: the slots are held), and only the rest take new slots. A write
        into a shared, not-full last block first moves the sequence to a
        private copy (copy-on-write). A block is hashed (findable) only once
        every one of its slots has a known value. `checked`: the caller
        found every token valid (`tokens_ok`) already."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        if not checked:
            check_tokens(tokens)
        if type(reserve) is not int or not 0 <= reserve <= MAX_RESERVE:
            raise InvalidArgument(f"reserve must be an integer in [0, {MAX_RESERVE}]")
        table = seq.table
        k = append_slots(len(tokens), seq.reserved, reserve)[1]  # the slots it adds
        B = self.block_size
        n = seq.num_tokens
        offset = n % B
        room = B - offset if offset else 0
        # NOTE: a reserved slot is never in a shared block (a sequence with
        # reserved slots cannot be forked, and its partly known block has no
        # hash), so filling one never copies.
        need, cow = append_blocks(n, k, self.ref_cnt[table[-1]] if table else 0, B)
        if need:
            available = self.num_free_blocks
            if need > available:
                self.out_of_blocks += 1
                raise OutOfBlocks(need, available)
            if need > cow:  # copy-on-write replaces an entry, adds none
                self._check_new_entries(need - cow)
                self.table_entries += need - cow

        keep = len(table)
        new_blocks: list[int] = []
        copies: list[tuple[int, int]] = []
        if cow:
            src = table[-1]
            dst = self._take()
            self.ref_cnt[src] -= 1
            self._fill[dst] = self._fill[src]
            table[-1] = dst
            keep -= 1
            new_blocks.append(dst)
            copies.append((src, dst))
            self.copies += 1
        left = k
        if room and left:
            put = min(room, k)
            self._fill[table[-1]] += put
            left -= put
        while left > 0:
            b = self._take()
            put = min(B, left)
            self._fill[b] = put
            table.append(b)
            new_blocks.append(b)
            left -= put
        seq.num_tokens, seq.reserved = after_append(n, seq.reserved, len(tokens), reserve)

        if self.enable_prefix_caching and tokens:
            seq.tail.extend(tokens)
            self._hash_full_tail(seq)
        return AppendResult(keep, new_blocks, copies)

    def append_run(
        self,
        seq_ids: Sequence[str],
        counts: Sequence[int],
        tokens: Sequence[int],
        reserved: Sequence[int],
        keep: list[int],
        num_appended: list[int],
        appended: list[int],
        i: int,
        stop: int,
        at: int,
    ) -> tuple[int, int]:
        """Operations i to stop - 1 of a step, each an APPEND (its sequence
        `seq_ids[i]`, its tokens `counts[i]` of `tokens` from `at` on, every
        token of the step found valid by the caller, `reserved[i]` slots
        reserved after them), applied in turn as `append` applies them
        while none copies a block: its slots fit in its sequence's private,
        not-full last block (a decode step's append), or the blocks it
        takes from the free queue are there (an append that crosses a
        block's end). Each one's answer is written to `keep[i]` (the table
        entries kept), `num_appended[i]` (the blocks taken) and the end of
        `appended` (their ids). Returns (the first operation not applied,
        where its tokens start): stop, or one `append` must apply (a copy on
        write, too few free blocks, a pool limit, an unknown sequence, bad
        input), of which nothing was changed.

        NOTE: the fast path of `append`, one call for a run of operations
        (the hot loop of a step); tests/core/test_fast_paths.py checks it
        against `append` alone."""
        seqs, fill, ref_cnt, B = self._seqs, self._fill, self.ref_cnt, self.block_size
        caching = self.enable_prefix_caching
        while i < stop:
            seq = seqs.get(seq_ids[i])
            reserve: object = reserved[i]
            if seq is None or type(reserve) is not int or not 0 <= reserve <= MAX_RESERVE:
                break
            n, c = seq.num_tokens, counts[i]
            held, seq_reserved = after_append(n, seq.reserved, c, reserve)
            table = seq.table
            kept = len(table)
            if held != n:
                offset = n % B
                if offset and ref_cnt[table[-1]] != 1:
                    break  # a write into a shared block: copy on write
                room = B - offset if offset else 0
                if held - n <= room:
                    fill[table[-1]] += held - n
                else:
                    left = held - n - room
                    need = append_blocks(n, held - n, 1, B)[0]  # (no copy: checked above)
                    if need > self.num_free_blocks or not self._entries_fit(need):
                        break  # refused by `append`'s rules
                    if room:
                        fill[table[-1]] += room
                    self.table_entries += need
                    while left > 0:
                        b = self._take()
                        put = min(B, left)
                        fill[b] = put
                        table.append(b)
                        appended.append(b)
                        left -= put
                    num_appended[i] = need
            seq.num_tokens, seq.reserved = held, seq_reserved
            if c and caching:
                tail = seq.tail
                if c == 1:  # a decode step's one token: no slice
                    tail.append(tokens[at])
                else:
                    tail += tokens[at : at + c]
                if len(tail) >= B:  # (checked here too: one call fewer a token)
                    self._hash_full_tail(seq)
            keep[i] = kept
            at += c
            i += 1
        return i, at

    def unreserve(self, seq_id: str, slots: object) -> int:
        """Give back the last `slots` of the sequence's reserved slots (held
        for tokens whose values were never sent: a worker's lookahead it no
        longer wants). Blocks left holding no slot return to the uncached
        free queue, in table order: a block with a reserved slot is private
        (a sequence holding reserved slots cannot be forked, and such a block
        is never hashed, so never found) and has no hash. Returns the table
        length (`keep`: the entries left)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        if type(slots) is not int or not 1 <= slots <= seq.reserved:
            raise InvalidArgument(
                f"unreserve: {seq_id!r} holds {seq.reserved} reserved slots; "
                f"cannot give back {slots!r}"
            )
        n = seq.num_tokens - slots
        B, table = self.block_size, seq.table
        keep = unreserve_keep(seq.num_tokens, slots, B)
        for b in table[keep:]:
            self.ref_cnt[b] = 0
            self._fill[b] = 0
            self._uncached_free.append(b)
        self.table_entries -= len(table) - keep
        del table[keep:]
        if keep:
            self._fill[table[-1]] = n - (keep - 1) * B
        seq.num_tokens, seq.reserved = after_unreserve(seq.num_tokens, seq.reserved, slots)
        return keep

    def _hash_full_tail(self, seq: SeqEntry) -> None:
        """Hash and register each block the sequence has just filled."""
        B, tail = self.block_size, seq.tail
        if len(tail) < B:
            return
        i = seq.num_hashed
        parent = seq.link(self.index.block_hash, i - 1) if i else self.root_hash
        hashes = hashing.extend_chain(parent, tail, B, seq.salt if i == 0 else None)
        full = len(hashes)
        seq.num_hashed = i + full
        self.index.register_run(seq.table[i : i + full], hashes)
        del tail[: full * B]

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """The child shares every block of the parent (refcount + 1 each);
        no data moves. Returns the child's table."""
        check_seq_id(child_id)
        parent = self._seqs.get(parent_id)
        if parent is None:
            raise UnknownSequence(parent_id)
        if child_id in self._seqs:
            raise SequenceExists(child_id)
        if parent.reserved:
            # The child would hold slots whose values only the parent sends.
            raise InvalidArgument(
                f"cannot fork {parent_id!r}: it has {parent.reserved} reserved slots "
                "whose tokens are not known yet"
            )
        names = _name_chars(child_id, parent.salt)
        self._check_new_sequence(names)
        self._check_new_entries(len(parent.table))
        self.table_entries += len(parent.table)
        self.name_chars += names
        for b in parent.table:
            self.ref_cnt[b] += 1
        self._seqs[child_id] = SeqEntry(
            table=list(parent.table),
            num_tokens=parent.num_tokens,
            salt=parent.salt,
            tail=list(parent.tail),
            num_hashed=parent.num_hashed,
            apart=parent.apart,
        )
        return list(parent.table)

    def free(self, seq_id: str) -> None:
        """Drop a sequence. Blocks no other table names return to the free
        queue: uncached ones in table order, cached ones (still findable)
        into the evictable queue tail first; with a shared store, cached
        ones the store lacks are written through to it."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(seq_id)
        self.table_entries -= len(seq.table)
        self.name_chars -= _name_chars(seq_id, seq.salt)
        cached: list[int] = []
        block_hash = self.index.block_hash
        keys = block_hash.keys
        for b in release(self.ref_cnt, seq.table):
            if keys[b] == NO_HASH:
                self._uncached_free.append(b)
            else:
                cached.append(b)
        clock, stamp, queue = self._clock, self._stamp, self._cached_free
        for b in reversed(cached):
            clock += 1
            stamp[b] = clock
            queue[b] = None
        self._clock = clock
        if self.tiers is not None:
            for b in reversed(cached):
                # tail first: a full store drops a chain's tail before its head
                self.tiers.released(b, block_hash[b])  # type: ignore[arg-type]

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of the KV pool; cached free blocks become
        plain free blocks (keeping their order). The tiers keep their entries.
        Returns how many hashes were dropped."""
        self._uncached_free.extend(self._cached_free)
        self._cached_free.clear()
        for seq in self._seqs.values():
            seq.detach(self.index.block_hash)
        return self.index.clear()

    # ------------------------------------------------------------------ tiers
    def confirm(
        self,
        saved: Sequence[int] = (),
        failed: Sequence[int] = (),
        store_saved: Sequence[bytes] = (),
        store_failed: Sequence[bytes] = (),
        refused: Sequence[bytes] = (),
    ) -> None:
        """A worker's report on the moves it applied: host slots whose save
        is written (`saved`) or could not be (`failed`), the same for store
        saves by hash, and store loads it refused (layout, checksum or the
        entry missing; it computed those tokens). Written saves become
        findable; failed and refused entries leave the index (a store delete
        is issued for them). InvalidArgument, changing nothing, for an id the
        pool could not have issued; an id of nothing pending is ignored, and
        so is a refusal of a hash no block of this pool holds: a worker can
        drop from the shared store only entries of what its own pool holds,
        not empty the index every pool shares."""
        args = (list(saved), list(failed), list(store_saved), list(store_failed), list(refused))
        self.check_report(*args)
        if self.tiers is not None:
            self.tiers.confirm(*args, holds=self.index.__contains__)

    def check_report(
        self,
        saved: Sequence[int] = (),
        failed: Sequence[int] = (),
        store_saved: Sequence[bytes] = (),
        store_failed: Sequence[bytes] = (),
        refused: Sequence[bytes] = (),
    ) -> None:
        """InvalidArgument unless `confirm` would take this report: every id
        one the pool could have issued (lookups only: callers check a report
        before they journal it)."""
        if self.tiers is None:
            if saved or failed or store_saved or store_failed or refused:
                raise InvalidArgument("save or load confirmations for a pool without KV tiers")
            return
        self.tiers.check_confirmations(
            list(saved), list(failed), list(store_saved), list(store_failed), list(refused)
        )

    def take_moves(self) -> Moves:
        """The tier moves issued since the last call, in the order the worker
        applies them (`tiers.Moves`), and the end of a step: entries loaded in
        it may be reused again."""
        return NO_MOVES if self.tiers is None else self.tiers.take_moves()

    def drop_store_pending(self) -> int:
        """The pool is dropped: its store saves not confirmed leave the
        shared store's index (a killed worker never confirms them)."""
        return 0 if self.tiers is None else self.tiers.drop_store_pending()

    # -------------------------------------------------------------- internals
    def _check_new_sequence(self, names: int) -> None:
        if len(self._seqs) >= self.max_sequences:
            raise PoolLimit(
                f"the pool holds its maximum of {self.max_sequences} sequences "
                f"({SEQUENCES_PER_BLOCK} per block, at least {MIN_SEQUENCES}); free some first"
            )
        if self.name_chars + names > self.max_name_chars:
            raise PoolLimit(
                f"{names} more characters of sequence id and salt would exceed the pool's maximum "
                f"of {self.max_name_chars} ({NAME_CHARS_PER_BLOCK} per block, at least "
                f"{MIN_NAME_CHARS}; in use: {self.name_chars})"
            )

    def _entries_fit(self, added: int) -> bool:
        return self.table_entries + added <= self.max_table_entries

    def _check_new_entries(self, added: int) -> None:
        if not self._entries_fit(added):
            raise PoolLimit(
                f"{added} more block-table entries would exceed the pool's maximum of "
                f"{self.max_table_entries} ({TABLE_ENTRIES_PER_BLOCK} per block, at least "
                f"{MIN_TABLE_ENTRIES}; in use: {self.table_entries})"
            )

    def _load(self, hits: list[int], hashes: list[bytes]) -> None:
        """An admission's tier hits (`hits[i] < 0`): each takes a fresh block,
        which gets its hash, and issues its load. The entries are pinned
        first, so no save these takes cause reuses them."""
        tiers = self.tiers
        assert tiers is not None
        tiers.pin((hashes[i], -b) for i, b in enumerate(hits) if b < 0)
        B = self.block_size
        for i, b in enumerate(hits):
            if b < 0:
                nb = self._take()
                self._fill[nb] = B
                self.index.register(nb, hashes[i])
                tiers.load(hashes[i], -b, nb, B)
                hits[i] = nb

    def _take_run(self, n: int) -> list[int]:
        """`n` blocks popped from the front of the free queue, as `n` calls of
        `_take` (the caller checked there are as many): the never-used ids,
        the uncached free blocks and the cached ones each as one run.

        NOTE: the run form of `_take` (an admission's blocks: one index call
        for its evictions, not one a block); tests/core/test_fast_paths.py
        checks it against `_take` one block at a time."""
        fresh = min(n, self.num_blocks - self._fresh)
        taken = self._ids[self._fresh : self._fresh + fresh]
        self._fresh += fresh
        if (rest := n - fresh) and (uncached := self._uncached_free):
            taken += [uncached.popleft() for _ in range(min(rest, len(uncached)))]
            rest = n - len(taken)
        if rest:
            pop = self._cached_free.popitem
            evicted = [pop(last=False)[0] for _ in range(rest)]
            self.evictions += rest
            if self.tiers is None:
                self.index.evict_run(evicted)
            else:  # in turn: whether another block still holds a hash decides a save
                for b in evicted:
                    h = self.index.evict(b)
                    if h not in self.index:
                        self.tiers.evicted(b, h)
            taken += evicted
        ref_cnt, fill = self.ref_cnt, self._fill
        for b in taken:
            ref_cnt[b] = 1
            fill[b] = 0
        return taken

    def _take(self) -> int:
        """Pop the front of the free queue (caller checked there is one). A
        cached block whose hash no other block holds is saved a tier down."""
        if self._fresh < self.num_blocks:
            b = self._ids[self._fresh]
            self._fresh += 1
        elif self._uncached_free:
            b = self._uncached_free.popleft()
        else:
            b, _ = self._cached_free.popitem(last=False)
            h = self.index.evict(b)
            self.evictions += 1
            if self.tiers is not None and h not in self.index:
                self.tiers.evicted(b, h)
        self.ref_cnt[b] = 1
        self._fill[b] = 0
        return b
