"""The allocator benchmarks' workloads (`bench core`, `bench allocator`, `bench host`,
`bench fleet`, `bench attention`): token ids a worker sends, no text."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from allocator_service.core import Admit, Append, Free, Op

VOCAB = 32_000


SYSTEM_PROMPT = list(range(1000, 1064))  # the prefix every decode-loop prompt shares


PROMPT_LEN = 128


MAX_GEN = 512


FINISH_P = 0.02  # chance a sequence finishes at each step: mean 50 tokens out


@dataclass(frozen=True)
class CoreWorkload:
    what: str = field(compare=False)
    sequences: int = 10_000
    prompt_len: int = 200  # prompt tokens per sequence
    shared_prefix: int = 128  # leading prompt tokens every sequence shares
    decode_rounds: int = 64  # tokens appended per sequence
    block_size: int = 16
    seed: int = 0


CORE = {
    "default": CoreWorkload("10,000 sequences of 200 prompt tokens (128 shared), 64 decode rounds"),
    "small": CoreWorkload("200 sequences, 8 decode rounds", sequences=200, decode_rounds=8),
}


@dataclass(frozen=True)
class StepWorkload:
    what: str = field(compare=False)
    sizes: tuple[int, ...] = (1, 64, 256)  # sequences per step, one case each
    steps: int = 400  # timed steps per case
    warmup: int = 50  # untimed steps first
    block_size: int = 16
    prefix_caching: bool = True
    # --noisy-neighbour: the victim's sequences per
    # step, the neighbour's pool and its admits' length
    victim_seqs: int = 64
    neighbour_blocks: int = 65_536
    neighbour_prompt: int = 32_768


STEPS = {
    "default": StepWorkload(
        "1, 64 and 256 sequences per step, 400 timed steps per case (noisy neighbour: a victim "
        "of 64 sequences beside a 65,536-block pool admitting 32,768 tokens at a time)"
    ),
    "long": StepWorkload(
        "the same with 2,000 timed steps per case, for steadier tails", steps=2000
    ),
    "small": StepWorkload(
        "1 and 8 sequences per step, 20 steps (noisy neighbour: 8 beside 2,048 blocks and "
        "1,024-token admits)",
        sizes=(1, 8),
        steps=20,
        warmup=2,
        victim_seqs=8,
        neighbour_blocks=2048,
        neighbour_prompt=1024,
    ),
}


@dataclass(frozen=True)
class HostWorkload:
    what: str = field(compare=False)
    sizes: tuple[int, ...] = (1, 64, 256)  # sequences running at once, one case each
    steps: int = 200  # timed steps per case, once every first request has its first token
    prompt_tokens: tuple[int, int] = (500, 1500)  # uniform, inclusive
    output_tokens: tuple[int, int] = (200, 400)
    max_num_batched_tokens: int = 8192
    seed: int = 0


HOST = {
    "default": HostWorkload(
        "1, 64 and 256 sequences running at once, prompts of 500-1,500 tokens, outputs of "
        "200-400 (ignore_eos), a new request as each finishes; 200 timed steps per case"
    ),
    "small": HostWorkload(
        "1 and 4 sequences, prompts of 50-100 tokens, outputs of 20-40, 10 timed steps",
        sizes=(1, 4),
        steps=10,
        prompt_tokens=(50, 100),
        output_tokens=(20, 40),
    ),
}


def decode_heavy_request(rng: random.Random, w: HostWorkload, vocab: int) -> tuple[list[int], int]:
    """A prompt of random ids (no two share a block) and its output length."""
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(*w.prompt_tokens))]
    return prompt, rng.randint(*w.output_tokens)


@dataclass(frozen=True)
class FleetWorkload:
    what: str = field(compare=False)
    worker: (
        HostWorkload  # the recorded worker: one size (sequences running at once), its timed steps
    )
    # replayed workers per allocator process, one case each
    workers: tuple[int, ...] = (1, 4, 8, 12, 16, 20, 24, 32)
    memory_blocks: int = 1 << 20  # blocks of state for the RSS per block
    memory_pools: int = 16
    floor_calls: int = 4000  # Steps with no operation, for what a call itself costs


FLEET = {
    "default": FleetWorkload(
        "one Llama-3-8B worker on sim:h100 with 256 sequences running (prompts of 500-1,500 "
        "tokens, outputs of 200-400, a new request as each finishes) recorded for 400 steps past "
        "its warm-up; 16 pools of 65,536 blocks for the memory figure",
        HostWorkload("256 sequences", sizes=(256,), steps=400),
    ),
    "small": FleetWorkload(
        "4 sequences of 50-100 prompt tokens recorded for 30 steps; 4,096 blocks",
        HostWorkload(
            "4 sequences", sizes=(4,), steps=30, prompt_tokens=(50, 100), output_tokens=(20, 40)
        ),
        workers=(1, 2),
        memory_blocks=4096,
        memory_pools=2,
        floor_calls=200,
    ),
}


@dataclass(frozen=True)
class AttentionWorkload:
    what: str = field(compare=False)
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (512, 2048)  # tokens per sequence
    block_size: int = 16
    # SmolLM2-135M's head shapes
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    dtype: str = "float32"
    seed: int = 0


ATTENTION = {
    "default": AttentionWorkload(
        "batches of 1, 16 and 64 sequences of 512 and 2,048 tokens, SmolLM2-135M's heads "
        "(9 query, 3 key/value, 64 wide), float32"
    ),
    "small": AttentionWorkload(
        "batches of 1 and 3 sequences of 40 tokens", batch_sizes=(1, 3), contexts=(40,)
    ),
}


def prompt_with_prefix(
    rng: random.Random, prefix: Sequence[int], length: int, vocab: int = VOCAB
) -> list[int]:
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
