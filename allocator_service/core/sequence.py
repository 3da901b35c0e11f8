"""One sequence's entry in a `BlockPool`, and how many blocks its tokens take."""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: a table's length (the block
    contract: token p lives in block p // block_size)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class SeqEntry:
    """A sequence as its pool holds it: its block table and token counts."""

    table: list[int]  # the block table, logical block i -> physical block
    num_tokens: int
    salt: str | None = None
    # Prefix caching only: the chain of hashes of the sequence's full blocks,
    # and the tokens of its partly filled last block (hashed once it fills).
    hashes: list[bytes] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    # Async scheduling: the last `reserved` of its `num_tokens` slots are held
    # for tokens whose values the worker has not sent yet (an APPEND that
    # reserves). Their values arrive, in order, with its next APPEND; a block
    # with a reserved slot is never hashed, so never found by another sequence.
    reserved: int = 0
