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

from pagedkv.bench.workloads.allocator import (
    ATTENTION,
    CORE,
    FINISH_P,
    FLEET,
    HOST,
    MAX_GEN,
    PROMPT_LEN,
    STEPS,
    SYSTEM_PROMPT,
    VOCAB,
    AttentionWorkload,
    CoreWorkload,
    FleetWorkload,
    HostWorkload,
    StepWorkload,
    decode_heavy_request,
    decode_steps,
    prompt_with_prefix,
)
from pagedkv.bench.workloads.attacks import (
    ATTACKS,
    AttackWorkload,
)
from pagedkv.bench.workloads.serving import (
    CHAT_SYSTEM_PROMPT,
    CONTEXT,
    KV_DTYPE,
    MULTIPLE_CHOICE,
    QUESTIONS,
    ROUTE,
    SERVE,
    TIERS,
    WORDS,
    Chat,
    KVDtypeWorkload,
    RouteWorkload,
    ServeWorkload,
    TiersWorkload,
    chat_prompts,
    common_prefix,
    multi_turn_chats,
    tenant_conversations,
    warmup_prompts,
)
from pagedkv.bench.workloads.streams import (
    PD,
    RESERVATION,
    PDWorkload,
    ReservationWorkload,
    chats_and_documents,
    poisson_arrivals,
    sharegpt_like_lengths,
)

__all__ = [
    "ATTACKS",
    "ATTENTION",
    "AttackWorkload",
    "AttentionWorkload",
    "CHAT_SYSTEM_PROMPT",
    "CONTEXT",
    "CORE",
    "Chat",
    "CoreWorkload",
    "FINISH_P",
    "FLEET",
    "FleetWorkload",
    "HOST",
    "HostWorkload",
    "KVDtypeWorkload",
    "KV_DTYPE",
    "MAX_GEN",
    "MULTIPLE_CHOICE",
    "PD",
    "PDWorkload",
    "PROMPT_LEN",
    "QUESTIONS",
    "RESERVATION",
    "ROUTE",
    "ReservationWorkload",
    "RouteWorkload",
    "SERVE",
    "STEPS",
    "SYSTEM_PROMPT",
    "ServeWorkload",
    "StepWorkload",
    "TIERS",
    "TiersWorkload",
    "VOCAB",
    "WORDS",
    "chat_prompts",
    "chats_and_documents",
    "common_prefix",
    "decode_heavy_request",
    "decode_steps",
    "multi_turn_chats",
    "poisson_arrivals",
    "prompt_with_prefix",
    "sharegpt_like_lengths",
    "tenant_conversations",
    "warmup_prompts",
]
