"""Open-loop request streams (`bench reservation`, `bench pd`): request lengths arriving as a
Poisson process."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReservationWorkload:
    what: str = field(compare=False)
    # a public config the simulated device serves (worker.sim.PUBLIC_CONFIGS)
    model: str = "opt-13b"
    requests: int = 400  # per rate: the same lengths at every rate, for every system
    # requests per second, in increasing order; a system's
    # sweep ends at its first rate over the bound
    rates: tuple[float, ...] = tuple(k / 4 for k in range(2, 25))  # 0.5, 0.75, ..., 6.0
    # ShareGPT's means in the vLLM paper's Figure 11 (input 161.31, output 337.99 tokens), each a
    # log-normal of this sigma (a long tail; our choice, not a fit of the data set)
    prompt_mean: float = 161.31
    output_mean: float = 337.99
    sigma: float = 0.8
    max_len: int = 2048  # prompt + output at most (OPT's context); longer draws are drawn again
    block_size: int = 16
    max_num_seqs: int = 256
    num_blocks: int | None = None  # None: as many as the simulated memory holds beside the weights
    # The normalized latency a rate must stay under to count as served: 0.1 s per output token end
    # to end (queueing included), 10 tokens/s, faster than anyone reads.
    latency_bound_s: float = 0.1
    seed: int = 0


RESERVATION = {
    "default": ReservationWorkload(
        "400 ShareGPT-like requests per rate (log-normal lengths, prompt + output <= 2,048: "
        "prompts 161 tokens and outputs 327 on average), Poisson arrivals at 0.5 to 6 requests/s "
        "in steps of 0.25, OPT-13B on the simulated GPU"
    ),
    "wide": ReservationWorkload(
        "the default's requests and lengths at 0.5 to 24 requests/s in steps of 0.5: room above "
        "the default's 6 for a pool that holds more (--kv-cache-dtype fp8)",
        rates=tuple(k / 2 for k in range(1, 49)),
    ),
    "small": ReservationWorkload(
        "24 requests per rate at 1, 4 and 16 requests/s, lengths at most 256, a pool of "
        "64 blocks, a bound of 0.05 s/token",
        requests=24,
        rates=(1.0, 4.0, 16.0),
        max_len=256,
        num_blocks=64,
        latency_bound_s=0.05,
    ),
}


def sharegpt_like_lengths(
    n: int, w: ReservationWorkload, rng: random.Random
) -> list[tuple[int, int]]:
    """`n` (prompt tokens, output tokens) pairs: each a log-normal draw of
    mean `w.prompt_mean` / `w.output_mean` and `w.sigma`, at least 1, the
    pair drawn again while it exceeds `w.max_len` (so the means come out a
    little lower than asked)."""

    def draw(mean: float) -> int:
        return max(1, round(rng.lognormvariate(math.log(mean) - w.sigma**2 / 2, w.sigma)))

    out: list[tuple[int, int]] = []
    while len(out) < n:
        prompt, output = draw(w.prompt_mean), draw(w.output_mean)
        if prompt + output <= w.max_len:
            out.append((prompt, output))
    return out


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from 0) of `n` requests of a Poisson process of
    `rate` per second: exponential gaps."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass(frozen=True)
class PDWorkload:
    what: str = field(compare=False)
    device: str = "sim:h100"  # the workers' --device (a sim: one serves `model`'s public config)
    model: str = "llama-3-8b"  # sim: a public config (worker/sim/configs.py); cpu: a model name
    requests: int = 480
    # the Poisson stream's mean arrival rate: near the colocated pair's capacity, the rate where
    # its TTFT p99 approaches the 2 s bound
    rate_rps: float = 18.0
    chat_tokens: tuple[int, int] = (200, 1000)  # a chat's prompt, uniform, inclusive
    document_tokens: tuple[int, int] = (4000, 8000)  # a long document's prompt
    document_share: float = 0.2  # the chance that a request is a long document
    output_tokens: int = 128  # every request's max_tokens (EOS ignored)
    vocab: tuple[int, int] = (1000, 32_000)  # prompt token ids, uniform in [low, high)
    max_num_seqs: int = 64
    ttft_slo_s: float = 2.0  # goodput: requests with TTFT <= this and TPOT <= tpot_slo_s
    tpot_slo_s: float = 0.05
    seed: int = 0


PD = {
    "default": PDWorkload(
        "480 requests in a Poisson stream of 18 requests/s: chats of 200-1,000 prompt tokens, "
        "1 in 5 a long document of 4,000-8,000, 128 output tokens each (EOS ignored); "
        "Llama-3-8B's config on sim:h100"
    ),
    "small": PDWorkload(
        "12 requests at 4 requests/s: chats of 40-120 prompt tokens, 1 in 4 a document of "
        "300-600, 12 output tokens; Llama-3-8B's config on sim:h100",
        requests=12,
        rate_rps=4.0,
        chat_tokens=(40, 120),
        document_tokens=(300, 600),
        document_share=0.25,
        output_tokens=12,
        max_num_seqs=16,
    ),
    "cpu": PDWorkload(
        "6 requests at 1 request/s on real CPU workers (--model tiny-random, or smollm2): "
        "prompts of 20-60 token ids, 1 in 3 of 100-200, 16 output tokens",
        device="cpu",
        model="tiny-random",
        requests=6,
        rate_rps=1.0,
        chat_tokens=(20, 60),
        document_tokens=(100, 200),
        document_share=0.34,
        output_tokens=16,
        vocab=(3, 259),  # within tiny-random's byte vocabulary and every real model's
        max_num_seqs=8,
    ),
}


def chats_and_documents(w: PDWorkload) -> list[tuple[float, list[int]]]:
    """`w.requests` (arrival second, prompt token ids): a Poisson stream of `w.rate_rps`, each
    prompt a chat's or (with chance `w.document_share`) a long document's, of random ids."""
    rng = random.Random(w.seed)
    arrivals = poisson_arrivals(w.requests, w.rate_rps, random.Random(w.seed + 1))
    out = []
    for at in arrivals:
        low, high = w.document_tokens if rng.random() < w.document_share else w.chat_tokens
        out.append((at, [rng.randrange(*w.vocab) for _ in range(rng.randint(low, high))]))
    return out
