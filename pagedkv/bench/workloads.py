"""The workloads of every benchmark, each written once.

- `decode_steps`: allocator operations, as a vLLM-style worker sends them:
  admit sequences whose prompts share a system prompt, then decode with
  turnover (`bench allocator`, its noisy neighbour's victim).
- `prompt_with_prefix`: a prompt behind a shared prefix (`bench core`, the
  noisy neighbour's long admits).
- `chat_prompts`: chat prompts with one system prompt and user messages of
  mixed lengths (`bench serve`).
- `tenant_conversations`: several tenants, each with its own long system
  prompt and several conversations, shuffled together (`bench route`).
- `warmup_prompts`: random ids that share no block with any of the above.
"""

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


# -- chat prompts (bench serve) ----------------------------------------------------------

CHAT_SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a small engineering team. Answer in plain English, "
    "keep answers short and concrete, and say so when you are not sure. Prefer numbered steps for "
    "procedures and short paragraphs otherwise. Never invent facts, links or numbers; when a question "
    "is ambiguous, state the reading you chose before you answer."
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
        messages = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}, {"role": "user", "content": user}]
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

WORDS = ("account", "billing", "cluster", "deploy", "engine", "fault", "gateway", "host", "index", "journal",
         "kernel", "latency", "memory", "network", "object", "packet", "queue", "replica", "storage", "tenant",
         "upgrade", "volume", "window", "yield", "zone")


def tenant_conversations(tokenizer, tenants: int, prompt_tokens: int, conversations: int,
                         seed: int) -> list[list[dict]]:
    """Chat message lists: each tenant's system prompt of about `prompt_tokens`
    tokens and `conversations` distinct questions, all tenants shuffled together."""
    rng = random.Random(seed)
    systems = []
    for i in range(tenants):
        words = [f"You are the assistant of tenant {i}. Their systems:"]
        while len(tokenizer.encode(" ".join(words))) < prompt_tokens:
            words.append(rng.choice(WORDS))
        systems.append(" ".join(words))
    requests = [[{"role": "system", "content": systems[i]},
                 {"role": "user", "content": f"Question {j} of tenant {i}: what about the {rng.choice(WORDS)}?"}]
                for i in range(tenants) for j in range(conversations)]
    rng.shuffle(requests)
    return requests
