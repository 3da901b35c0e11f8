"""Workloads the benchmarks share: prompts behind a common system prompt, and
an endless decode loop with turnover, as a vLLM-style worker runs it."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from allocator_service.core import Admit, Append, Free, Op

VOCAB = 32_000
SYSTEM_PROMPT = list(range(1000, 1064))  # the prefix every decode-loop prompt shares
PROMPT_LEN = 128
MAX_GEN = 512
FINISH_P = 0.02  # chance a sequence finishes at each step: mean 50 tokens out


def prompt_with_prefix(rng: random.Random, prefix: Sequence[int], length: int, vocab: int = VOCAB) -> list[int]:
    """`prefix` followed by random tokens, `length` tokens in all."""
    return [*prefix, *(rng.randrange(vocab) for _ in range(length - len(prefix)))]


def decode_steps(num_seqs: int, seed: int) -> Iterator[list[Op]]:
    """Endless steps: admit `num_seqs` sequences, then decode with turnover."""
    rng = random.Random(seed)
    serial = 0
    running: dict[str, int] = {}  # seq -> tokens generated

    def admit() -> Admit:
        nonlocal serial
        serial += 1
        seq = f"s{serial}"
        running[seq] = 0
        return Admit(seq, prompt_with_prefix(rng, SYSTEM_PROMPT, PROMPT_LEN))

    yield [admit() for _ in range(num_seqs)]
    while True:
        ops: list[Op] = []
        for seq in list(running):
            if running[seq] >= MAX_GEN or rng.random() < FINISH_P:
                del running[seq]
                ops.append(Free(seq))
        for seq in running:
            ops.append(Append(seq, [rng.randrange(VOCAB)]))
            running[seq] += 1
        ops.extend(admit() for _ in range(num_seqs - len(running)))
        yield ops
