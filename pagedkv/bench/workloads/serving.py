"""The serving benchmarks' workloads (`bench serve`, `bench route`, `bench tiers`,
`bench kv-dtype`): prompts of text, chats and questions."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field


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
