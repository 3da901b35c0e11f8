"""The attack drill's workload (`bench attacks`): the victim's load, each attack's size and how
long it runs."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        "0.5 s alone, 1 s of each attack, every attack smaller; the router's read deadlines "
        "1 s each, its first-byte timeout 1.5 s",
        baseline_s=0.5,
        attack_s=1.0,
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
