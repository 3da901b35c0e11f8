"""One sequence's entry in a `BlockPool`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from allocator_service.core.block_hashes import BlockHashes


@dataclass(slots=True)
class SeqEntry:
    """A sequence as its pool holds it: its block table and token counts."""

    table: list[int]  # the block table, logical block i -> physical block
    num_tokens: int
    salt: str | None = None
    # Prefix caching only: the tokens of its partly filled last block (hashed
    # once it fills) ...
    tail: list[int] = field(default_factory=list)
    # Async scheduling: the last `reserved` of its `num_tokens` slots are held
    # for tokens whose values the worker has not sent yet (an APPEND that
    # reserves). Their values arrive, in order, with its next APPEND; a block
    # with a reserved slot is never hashed, so never found by another sequence.
    reserved: int = 0
    # ... and the chain of hashes of its first `num_hashed` blocks (`chain`):
    # each is the hash its block holds, but for the first `len(apart)`, kept
    # here because their blocks no longer hold them (a cache reset cleared
    # the hashes of blocks in use) or never did (a dump's chain).
    num_hashed: int = 0
    apart: tuple[bytes, ...] = ()

    def chain(self, block_hash: BlockHashes) -> list[bytes]:
        """The hashes of its full blocks, first first: its prefix chain."""
        own = block_hash.at(self.table[len(self.apart) : self.num_hashed])
        assert None not in own, "a chain's block holds its hash (integrity_problems checks it)"
        return [*self.apart, *cast(list[bytes], own)]

    def link(self, block_hash: BlockHashes, i: int) -> bytes:
        """Hash `i` of its chain (i < num_hashed), to chain the next from."""
        h = self.apart[i] if i < len(self.apart) else block_hash[self.table[i]]
        assert h is not None, "a chain's block holds its hash (integrity_problems checks it)"
        return h

    def detach(self, block_hash: BlockHashes) -> None:
        """Keep its whole chain apart (its blocks are about to lose their hashes)."""
        if len(self.apart) < self.num_hashed:
            self.apart = tuple(self.chain(block_hash))

    def compact(self, block_hash: BlockHashes) -> None:
        """Keep apart only the hashes its blocks do not hold (the chain is
        unchanged): the leading part up to the last such hash."""
        apart, table = self.apart, self.table
        j, n = len(apart), len(block_hash)
        while j and j <= len(table) and 0 <= (b := table[j - 1]) < n:
            if not block_hash.holds_hash(b, apart[j - 1]):
                break
            j -= 1
        self.apart = apart[:j]
