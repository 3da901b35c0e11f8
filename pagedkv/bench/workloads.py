"""The workloads of every benchmark, each written once.

Each benchmark runs one named preset of its workload (`--workload NAME`,
`default` unless told): the sizes, lengths and shapes that define what it
measures. `small` is every benchmark's quick run, seconds long, to check that
it works (the test suite runs it); its figures compare nothing.

- `CORE` (`bench core`): sequences admitted behind a shared prefix, decoded,
  freed (`prompt_with_prefix`).
- `STEPS` (`bench allocator`): allocator operations, as a vLLM-style worker
  sends them: admit sequences whose prompts share a system prompt, then decode
  with turnover (`decode_steps`); and its noisy neighbour's long admits.
- `ATTENTION` (`bench attention`): decode attention over a paged pool.
- `SERVE` (`bench serve`): chat prompts with one system prompt and user
  messages of mixed lengths (`chat_prompts`).
- `ROUTE` (`bench route`): several tenants, each with its own long system
  prompt and several conversations, shuffled together (`tenant_conversations`).
- `TIERS` (`bench tiers`): multi-turn chats, each turn the whole history plus
  a new user message (`multi_turn_chats`).
- `ATTACKS` (`bench attacks`): the victim's load, each attack's size and how
  long it runs.
- `HOST` (`bench host`): decode-heavy chats on a simulated GPU, a fixed number
  running at once (`decode_heavy_request`).
- `FLEET` (`bench fleet`): one `HOST` worker's Step stream recorded, then
  replayed by many workers at once.
- `warmup_prompts`: random ids that share no block with any of the above.
- `RESERVATION` (`bench reservation`): ShareGPT-like request lengths
  (`sharegpt_like_lengths`) arriving as a Poisson process at increasing rates
  (`poisson_arrivals`).
- `PD` (`bench pd`): chats mixed with long documents, arriving as a Poisson
  process (`chats_and_documents`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from allocator_service.core import Admit, Append, Free, Op

VOCAB = 32_000
SYSTEM_PROMPT = list(range(1000, 1064))  # the prefix every decode-loop prompt shares
PROMPT_LEN = 128
MAX_GEN = 512
FINISH_P = 0.02  # chance a sequence finishes at each step: mean 50 tokens out


# -- the allocator core (bench core) -------------------------------------------------------


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


# -- Step latency (bench allocator) ----------------------------------------------------------


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


# -- the host's cost per step on a simulated GPU (bench host) ---------------------------------


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


FLEET = {
    "default": FleetWorkload(
        "one Llama-3-8B worker on sim:h100 with 256 sequences running (prompts of 500-1,500 "
        "tokens, outputs of 200-400, a new request as each finishes) recorded for 400 steps past "
        "its warm-up, replayed by 1 to 32 workers; 16 pools of 65,536 blocks for the memory figure",
        HostWorkload("256 sequences", sizes=(256,), steps=400),
    ),
    "small": FleetWorkload(
        "4 sequences of 50-100 prompt tokens recorded for "
        "30 steps, replayed by 1 and 2 workers; 4,096 blocks",
        HostWorkload(
            "4 sequences", sizes=(4,), steps=30, prompt_tokens=(50, 100), output_tokens=(20, 40)
        ),
        workers=(1, 2),
        memory_blocks=4096,
        memory_pools=2,
    ),
}


# -- paged decode attention (bench attention) ------------------------------------------------


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


# -- chat prompts (bench serve) ----------------------------------------------------------


@dataclass(frozen=True)
class ServeWorkload:
    what: str = field(compare=False)
    requests: int = 32  # all arriving at once, greedy
    max_tokens: int = 64  # generated per request, EOS ignored
    batch_size: int = 16  # rows per transformers static generate() batch
    block_size: int = 16
    max_num_seqs: int = 64  # the engine's, and per step in transformers' continuous batching
    max_num_batched_tokens: int = 2048  # per-step token budget of both
    lookahead: int = 8  # the engine's lookahead slots (the worker's default)


SERVE = {
    "default": ServeWorkload(
        "32 chat requests of mixed lengths x 64 tokens, transformers' static batches of 16"
    ),
    "small": ServeWorkload(
        "4 requests x 4 tokens, static batches of 3", requests=4, max_tokens=4, batch_size=3
    ),
}


CHAT_SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a small engineering team. Answer in plain English, "
    "keep answers short and concrete, and say so when you are not sure. Prefer numbered steps for "
    "procedures and short paragraphs otherwise. Never invent facts, links or numbers; when a "
    "question is ambiguous, state the reading you chose before you answer."
)

QUESTIONS = (
    "What is the capital of France?",
    "Explain what a hash table is.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me three tips for writing clear commit messages.",
    "What does HTTP status code 404 mean?",
    "Summarise the water cycle.",
    "How does a binary search work?",
    "What is the difference between a process and a thread?",
    "Suggest a name for a cat.",
    "What causes the seasons on Earth?",
    "How do I make a cup of green tea?",
)

CONTEXT = (
    "Some background: our service stores user sessions in memory and restarts every night.",
    "We run on two small virtual machines behind a load balancer in one region.",
    "The team is five people, two of them new to the codebase this month.",
    "Last week a deployment failed because a configuration file had a typo in a port number.",
    "Most requests are short, but a few reports take several minutes to build.",
    "We log every request with its latency, status code and the user's region.",
    "The database is a single PostgreSQL instance with daily backups kept for a week.",
    "Our customers are mostly small shops that use the product during business hours.",
    "I have read the documentation twice and still find this part confusing.",
)


def chat_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    """Chat prompt ids: one shared system prompt, user messages of mixed lengths."""
    prompts = []
    for i in range(num_requests):
        extra = (i * 5) % (len(CONTEXT) + 1)  # 0..9 background sentences, spread over the requests
        sentences = [CONTEXT[(i + j) % len(CONTEXT)] for j in range(extra)]
        user = " ".join([*sentences, QUESTIONS[i % len(QUESTIONS)]])
        messages = [
            {"role": "system", "content": CHAT_SYSTEM_PROMPT},
            {"role": "user", "content": user},
        ]
        prompts.append(tokenizer.encode_chat(messages))
    return prompts


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt shares."""
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        k = 0
        while k < min(n, len(p)) and p[k] == first[k]:
            k += 1
        n = k
    return n


def warmup_prompts(vocab_size: int, lengths: Sequence[int] = (12, 40)) -> list[list[int]]:
    """Random ids: they share no block with any workload, so nothing is pre-cached."""
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


# -- tenants (bench route) -----------------------------------------------------------------


@dataclass(frozen=True)
class RouteWorkload:
    what: str = field(compare=False)
    model: str = "tiny-random"  # of the workers and routers
    tenants: int = 8  # one system prompt each
    prompt_tokens: int = 400  # per system prompt
    conversations: int = 8  # per tenant
    concurrency: int = 8  # requests in flight
    max_tokens: int = 16  # generated per request
    num_blocks: int = 128  # KV blocks per worker (of `block_size` tokens)
    block_size: int = 16
    rounds: int = 2  # interleaved
    probe_requests: int = 40  # sequential requests for the router's added latency, each way
    seed: int = 0


ROUTE = {
    "default": RouteWorkload(
        "8 tenants x 8 conversations, ~400-token system prompts, 2 workers of 128 blocks "
        "(a part of the prefixes), 2 rounds"
    ),
    "tight": RouteWorkload(
        "~128-token system prompts and 2 workers of 48 blocks: the pools hold exactly the "
        "working set when each worker keeps its half of the prefixes; 6 rounds",
        prompt_tokens=128,
        num_blocks=48,
        rounds=6,
        probe_requests=10,
    ),
    "smollm2": RouteWorkload(
        "the default on SmolLM2-135M (the demo model, a real one: a prompt's tokens cost "
        "what they cost there); 2 rounds",
        model="smollm2",
        probe_requests=10,
    ),
    "small": RouteWorkload(
        "2 tenants x 2 conversations, ~40-token prompts, 2 tokens each",
        tenants=2,
        prompt_tokens=40,
        conversations=2,
        max_tokens=2,
        probe_requests=3,
    ),
}


WORDS = (
    "account",
    "billing",
    "cluster",
    "deploy",
    "engine",
    "fault",
    "gateway",
    "host",
    "index",
    "journal",
    "kernel",
    "latency",
    "memory",
    "network",
    "object",
    "packet",
    "queue",
    "replica",
    "storage",
    "tenant",
    "upgrade",
    "volume",
    "window",
    "yield",
    "zone",
)


def tenant_conversations(
    tokenizer, tenants: int, prompt_tokens: int, conversations: int, seed: int
) -> list[list[dict]]:
    """Chat message lists: each tenant's system prompt of about `prompt_tokens`
    tokens and `conversations` distinct questions, all tenants shuffled together."""
    rng = random.Random(seed)
    systems = []
    for i in range(tenants):
        words = [f"You are the assistant of tenant {i}. Their systems:"]
        while len(tokenizer.encode(" ".join(words))) < prompt_tokens:
            words.append(rng.choice(WORDS))
        systems.append(" ".join(words))
    requests = [
        [
            {"role": "system", "content": systems[i]},
            {
                "role": "user",
                "content": f"Question {j} of tenant {i}: what about the {rng.choice(WORDS)}?",
            },
        ]
        for i in range(tenants)
        for j in range(conversations)
    ]
    rng.shuffle(requests)
    return requests


# -- multi-turn chats (bench tiers) --------------------------------------------------------


@dataclass(frozen=True)
class TiersWorkload:
    what: str = field(compare=False)
    model: str = "tiny-random"
    conversations: int = 9  # odd: round-robin over two workers changes worker at every turn
    turns: int = 8  # per conversation, each sending the whole history plus a new message
    system_tokens: int = 64  # about, per conversation's own system prompt
    user_tokens: int = 96  # about, per new user message
    max_tokens: int = 32  # generated per turn, EOS ignored
    block_size: int = 16
    rounds: int = 2  # interleaved
    seed: int = 0


TIERS = {
    "default": TiersWorkload(
        "9 conversations x 8 turns, ~96 new tokens and 32 generated per turn, 2 rounds"
    ),
    "small": TiersWorkload(
        "5 conversations x 3 turns, ~24 new tokens and 4 generated per turn, 1 round",
        conversations=5,
        turns=3,
        system_tokens=16,
        user_tokens=24,
        max_tokens=4,
        block_size=4,
        rounds=1,
    ),
}


@dataclass(frozen=True)
class Chat:
    """One conversation's system prompt and its user messages, one per turn."""

    system: str
    users: tuple[str, ...]


def multi_turn_chats(
    tokenizer, conversations: int, turns: int, system_tokens: int, user_tokens: int, seed: int
) -> list[Chat]:
    """`conversations` chats, each with a system prompt of its own (about
    `system_tokens` tokens) and `turns` user messages of about `user_tokens`."""
    rng = random.Random(seed)

    def text(head: str, tokens: int) -> str:
        words = [head]
        while len(tokenizer.encode(" ".join(words))) < tokens:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    return [
        Chat(
            text(f"You are the assistant of conversation {c}.", system_tokens),
            tuple(text(f"Turn {t} of conversation {c}:", user_tokens) for t in range(turns)),
        )
        for c in range(conversations)
    ]


# -- attacks on a stack (bench attacks) ----------------------------------------------------


@dataclass(frozen=True)
class AttackWorkload:
    what: str = field(compare=False)
    baseline_s: float = 5.0  # the victim alone before each attack
    attack_s: float = 12.0  # each attack running (its set-up and teardown besides)
    victim_seqs: int = 16  # sequences per Step of the victim pool's decode loop
    router_max_tokens: int = 2  # per request of the victim's router loop
    idle_connections: int = 1000  # to the allocator's HTTP port
    slow_clients: int = 200  # slow heads, and as many slow bodies, on the router
    # the router's read deadlines in seconds (its settings' defaults: 10 and 60)
    router_header_timeout_s: float = 10.0
    router_body_timeout_s: float = 60.0
    tokenize_bytes: int = 3 << 20  # the text of one /tokenize with its token strings
    # slow-read flood: pools, checks in flight of each, their blocks and tokens
    flood_pools: int = 12
    flood_in_flight: int = 24
    flood_blocks: int = 32768
    flood_tokens: int = 16384
    snapshot_steps: int = 8  # snapshot amplification: steps of forks (ids of 256 characters)
    snapshot_forks: int = 500
    watchers: int = 8  # WatchEvents snapshot watchers
    # cached in a pool of their own for the watchers to read (blocks of 16)
    watched_tokens: int = 262_144
    snapshot_every: int = 100  # the allocator's journal records between snapshots
    # store poisoning: prompts of each way (planted through the protocol, written over existing
    # entries) and their full blocks; prompt reading: the full blocks of the prompt with the secret
    poison_prompts: int = 4
    prompt_blocks: int = 8
    evil_answers: int = 4  # an evil worker's huge answers at once, each of evil_answer_mb
    evil_answer_mb: int = 300
    router_first_byte_timeout_s: float = 10.0  # the router's (its settings' default: 60)


ATTACKS = {
    "default": AttackWorkload(
        "5 s of the victim alone, then 12 s of each attack: 1,000 idle connections, 200 slow "
        "heads and 200 slow bodies, a 3 MiB /tokenize, 12 pools x 24 integrity checks, "
        "4,000 forks with 256-character ids, 8 watchers of 16,384 cached blocks, a prompt "
        "of 8 blocks read back, 4 + 4 prompts of 8 blocks poisoned, 4 answers of 300 MB "
        "and 2 trickled ones from an evil worker (the router's first-byte timeout 10 s)"
    ),
    "small": AttackWorkload(
        "1 s alone, 2 s of each attack, every attack smaller; the router's read deadlines "
        "1 s each, its first-byte timeout 1.5 s",
        baseline_s=1.0,
        attack_s=2.0,
        victim_seqs=4,
        idle_connections=100,
        slow_clients=10,
        router_header_timeout_s=1.0,
        router_body_timeout_s=1.0,
        tokenize_bytes=256 << 10,
        flood_pools=3,
        flood_in_flight=12,
        flood_blocks=2048,
        flood_tokens=4096,
        snapshot_steps=2,
        snapshot_forks=200,
        watched_tokens=16_384,
        poison_prompts=2,
        prompt_blocks=4,
        evil_answer_mb=64,
        router_first_byte_timeout_s=1.5,
    ),
}


# -- reservation baselines (bench reservation) ---------------------------------------------


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
class KVDtypeWorkload:
    what: str = field(compare=False)
    model: str = "smollm2"
    prompts: int = len(QUESTIONS)  # the first N of QUESTIONS, asked as plain completions
    # greedy continuations compared at these lengths (the last is generated)
    tokens: tuple[int, ...] = (16, 64)
    questions: int = 20  # the first N of MULTIPLE_CHOICE
    kv_cache_memory: str = "256MiB"


KV_DTYPE = {
    "default": KVDtypeWorkload(
        f"SmolLM2-135M: {len(QUESTIONS)} prompts continued for 64 tokens, 20 four-option questions"
    ),
    "small": KVDtypeWorkload(
        "tiny-random: 3 prompts continued for 16 tokens, 4 questions",
        model="tiny-random",
        prompts=3,
        tokens=(4, 16),
        questions=4,
        kv_cache_memory="16MiB",
    ),
}

# (question, four options, the index of the right one): general knowledge a small model may know,
# scored as lm-eval scores a multiple-choice task (the options' log-likelihood after the question).
MULTIPLE_CHOICE: tuple[tuple[str, tuple[str, str, str, str], int], ...] = (
    ("The capital of France is", ("Paris", "Berlin", "Madrid", "Rome"), 0),
    (
        "Water freezes at a temperature of",
        ("0 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius", "200 degrees Celsius"),
        0,
    ),
    ("The largest planet in the solar system is", ("Mercury", "Mars", "Jupiter", "Venus"), 2),
    ("A week has", ("five days", "seven days", "ten days", "twelve days"), 1),
    ("The opposite of hot is", ("cold", "loud", "tall", "fast"), 0),
    ("Bees make", ("milk", "honey", "silk", "wool"), 1),
    ("The sun rises in the", ("north", "south", "west", "east"), 3),
    ("A triangle has", ("three sides", "four sides", "five sides", "six sides"), 0),
    ("The chemical symbol for water is", ("CO2", "H2O", "NaCl", "O3"), 1),
    ("The first month of the year is", ("March", "June", "January", "October"), 2),
    ("Cows say", ("moo", "meow", "woof", "quack"), 0),
    ("Two plus two equals", ("three", "four", "five", "six"), 1),
    ("The colour of grass is", ("blue", "red", "purple", "green"), 3),
    ("Fish live in", ("water", "sand", "trees", "clouds"), 0),
    ("The planet we live on is", ("Mars", "Earth", "Saturn", "Neptune"), 1),
    ("Ice is frozen", ("milk", "oil", "water", "juice"), 2),
    ("A spider has", ("two legs", "four legs", "six legs", "eight legs"), 3),
    ("The moon orbits the", ("Earth", "Sun", "Mars", "Venus"), 0),
    ("Paper is made from", ("stone", "wood", "glass", "iron"), 1),
    ("The language spoken in Spain is", ("German", "Japanese", "Spanish", "Russian"), 2),
)


# -- prefill/decode disaggregation (bench pd) -------------------------------------------------


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
