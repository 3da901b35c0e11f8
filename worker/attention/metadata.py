"""What one model step needs to know to write and read the paged KV cache.

A step (one forward pass) serves a batch of sequences. Each brings some NEW
tokens: a decode brings one, a prefill brings its prompt (or a chunk of it), and
a prefill may start after a cached prefix. The new tokens of all sequences are
concatenated, sequence by sequence, into the step's `T` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from allocator_service.core import blocks_for

__all__ = ["AttentionMetadata", "SeqSpec"]

# (block_table, num_computed_tokens, num_new_tokens): the builder's input per sequence.
SeqSpec = tuple[Sequence[int], int, int]


@dataclass(frozen=True, slots=True, eq=False)
class AttentionMetadata:
    """One batch's paged-attention description. Build it with `AttentionMetadata.build`.

    Device tensors:
    - `slot_mapping` [T] int64: flat slot (`block * B + offset`) where new token
      `i`'s K/V is written; -1 means "do not write" (padding).
    - `query_start_loc` [batch+1] int32: sequence `s`'s new tokens are rows
      `query_start_loc[s]:query_start_loc[s+1]`.
    - `context_lens` [batch] int32: tokens in sequence `s`'s cache AFTER this
      step's writes (cached + new). Its new tokens sit at the last positions.
    - `block_tables` [batch, max_blocks] int32: physical block per logical block;
      entries past `ceil(context_len / B)` are padding and are never read.

    Host copies (`host_query_lens`, `host_context_lens`) let backends plan without a device
    sync. Invariants (checked): every sequence has >= 1 new token, new <= context,
    and the block table covers the context.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    host_query_lens: tuple[int, ...]
    host_context_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        batch = len(self.host_query_lens)
        if batch == 0:
            raise ValueError("an attention batch needs at least one sequence")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if len(self.host_context_lens) != batch:
            raise ValueError("host_query_lens and host_context_lens differ in length")
        for s, (q, c) in enumerate(zip(self.host_query_lens, self.host_context_lens, strict=True)):
            if not 1 <= q <= c:
                raise ValueError(f"sequence {s}: need 1 <= new tokens ({q}) <= context ({c})")
        expected = {
            "slot_mapping": ((sum(self.host_query_lens),), torch.int64),
            "query_start_loc": ((batch + 1,), torch.int32),
            "context_lens": ((batch,), torch.int32),
        }
        for name, (shape, dtype) in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}"
                )
        bt = self.block_tables
        if bt.dim() != 2 or bt.shape[0] != batch or bt.dtype != torch.int32:
            raise ValueError(
                f"block_tables: expected int32 [{batch}, "
                f"max_blocks], got {bt.dtype} {tuple(bt.shape)}"
            )
        if blocks_for(max(self.host_context_lens), self.block_size) > bt.shape[1]:
            raise ValueError("block_tables has fewer columns than the longest context needs")

    # -- sizes ----------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.host_query_lens)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_query_len(self) -> int:
        return max(self.host_query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.host_context_lens)

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return self.max_query_len == 1

    # -- helpers for the engine -----------------------------------------------

    def positions(self) -> torch.Tensor:
        """[T] int64 positions of the new tokens (the new tokens end the context)."""
        q = np.asarray(self.host_query_lens, dtype=np.int64)
        starts = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        pos = _positions(q, np.asarray(self.host_context_lens, dtype=np.int64), starts)
        return torch.from_numpy(pos).to(self.slot_mapping.device)

    def last_token_indices(self) -> torch.Tensor:
        """[batch] int64 row of each sequence's last new token: where to take logits."""
        return (self.query_start_loc[1:] - 1).to(torch.int64)

    # -- construction ---------------------------------------------------------

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqSpec],
        block_size: int,
        device: str | torch.device = "cpu",
        pad_block_id: int = 0,
    ) -> AttentionMetadata:
        """Metadata for `seqs`, each `(block_table, num_computed_tokens, num_new_tokens)`.

        The block table must already cover `num_computed + num_new` tokens (the
        allocator extended it this step). `pad_block_id` fills the ragged tail of
        `block_tables`; tests set it to a poisoned block to prove it is never read.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        batch = len(seqs)
        width = max((len(table) for table, _, _ in seqs), default=0)
        # NumPy, not Python loops per token nor torch.tensor(list of lists):
        # built every step, this was about 1 ms for a 32-sequence decode batch.
        rows = np.full((batch, width), pad_block_id, dtype=np.int64)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for s, (table, computed, new) in enumerate(seqs):
            total = computed + new
            if computed < 0 or new < 1:
                raise ValueError(
                    f"sequence {s}: need num_computed >= 0 and num_new >= 1, got {computed}, {new}"
                )
            if len(table) * block_size < total:
                raise ValueError(
                    f"sequence {s}: block table of {len(table)} blocks x {block_size} "
                    f"cannot hold {total} tokens"
                )
            rows[s, : len(table)] = table
            query_lens.append(new)
            seq_lens.append(total)
        q = np.asarray(query_lens, dtype=np.int64)
        starts = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        owner = np.repeat(np.arange(batch), q)  # the sequence of each new token
        pos = _positions(q, np.asarray(seq_lens, dtype=np.int64), starts)
        slots = rows[owner, pos // block_size] * block_size + pos % block_size
        dev = torch.device(device)
        return cls(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev),
            context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(rows.astype(np.int32)).to(dev),
            block_size=block_size,
            host_query_lens=tuple(query_lens),
            host_context_lens=tuple(seq_lens),
        )


def _positions(query_lens: np.ndarray, context_lens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """int64 position of every new token: sequence s's run context-new .. context-1."""
    total = int(starts[-1])
    first = np.repeat(context_lens - query_lens - starts[:-1], query_lens)
    return np.arange(total, dtype=np.int64) + first
