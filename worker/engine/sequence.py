"""A request as the engine tracks it.

One list, `token_ids` = prompt + generated, drives prefill, chunked prefill,
decode and recompute after preemption alike: each step the sequence computes
the K/V of `token_ids[num_stored : num_stored + n]`, and when that reaches the
end of the list the step's logits give the next token.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from worker.engine.sampling import Logprobs, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not in the allocator (new, or preempted)
    RUNNING = "running"  # holds blocks
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved limit of generated tokens
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    # Parallel sampling (n > 1): sample `index` of its request. Samples 1..n-1
    # draw their first token from sample 0's prompt logits, then become FORKS
    # of it in the allocator (`fork_parent` until then), sharing its blocks.
    index: int = 0
    fork_parent: Sequence | None = None
    children: list[Sequence] = field(default_factory=list)  # samples 1..n-1, on sample 0
    logprobs: list[Logprobs] | None = None  # per generated token, when asked for
    # per prompt token (the first: None), filled in order as its positions are
    # computed; the samples of a request share sample 0's list
    prompt_logprobs: list[Logprobs | None] | None = None
    # the salt its admissions send: the request's, or for prompt logprobs a
    # salt of its own (no prefix-cache hit can skip a position it needs)
    cache_salt: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_stored: int = 0  # tokens whose K/V is computed (or computing, by the step in flight)
    # slots the allocator holds for it (>= num_stored: a call may hold slots
    # ahead, `--num-lookahead-slots`), and of those the last ones whose token
    # values it has not been sent yet (reserved: tokens being sampled, or
    # not sampled yet, or computed by steps that made no call)
    num_held: int = 0
    num_reserved: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # cached tokens of its first admission ("Counts"), as usage says
    admitted_once: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_scheduled_time: float | None = None  # the end of its queue time (metrics)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # streamed text: all decoded text, how much was emitted, how far stop
    # strings were searched
    detokenizer: object | None = None
    text: str = ""
    emitted: int = 0
    checked: int = 0
    stopped_by_string: bool = False
    # allocator sequence id: a new one per admission, so a preempted
    # sequence's old id can never collide with its readmission
    alloc_id: str = ""
    _admissions: int = 0
    # swap mode, while preempted: its K/V tail kept in the host tier (worker.engine.tiers.SwapStash)
    swap: object | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_valued(self) -> int:
        """Slots the allocator holds with their token values (the rest of
        `num_held` is reserved)."""
        return self.num_held - self.num_reserved

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_computed_tokens(self) -> int:
        """The most tokens whose K/V this sequence can ever compute: prompt
        + `max_tokens` - 1 (its last token is sampled, never fed back)."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def unforked_samples(self) -> list[Sequence]:
        """The samples that draw their first token from this sequence's
        prompt logits: when it computes its last prompt token, the model
        runner samples each of them from the same row (n > 1)."""
        if not self.children or self.num_output_tokens:
            return []
        return [
            c
            for c in self.children
            if c.fork_parent is self and not c.is_finished and c.num_output_tokens == 0
        ]

    def next_alloc_id(self) -> str:
        self._admissions += 1
        sample = f"/{self.index}" if self.index else ""
        self.alloc_id = f"{self.request_id}{sample}#{self._admissions}"
        return self.alloc_id

    def reset_for_recompute(self) -> None:
        """Preempted: blocks given back; everything computed so far is redone
        (cheaply when its blocks are still in the prefix cache)."""
        self.status = Status.WAITING
        self.num_stored = 0
        self.num_held = 0
        self.num_reserved = 0
        self.block_table = []
        self.num_preemptions += 1


def kv_in_use(seqs: Iterable[Sequence], block_size: int) -> tuple[int, int]:
    """(blocks, slots holding a token) the sequences' block tables name, a
    shared block once. Every block but a table's last is full; a shared last
    block holds as many tokens for every sharer (the allocator's invariant)."""
    used: set[int] = set()
    empty: dict[int, int] = {}  # a table's last block -> its slots holding no token
    for seq in seqs:
        table = seq.block_table
        if table:
            used.update(table)
            empty[table[-1]] = len(table) * block_size - seq.num_held
    return len(used), len(used) * block_size - sum(empty.values())
