"""`pagedkv bench attacks`: the trust-boundary attacks against a stack with
credentials and one without, and what the victim and the allocator felt.

Each stack is what `pagedkv up --redis` runs, as real processes
(`pagedkv.stack.LocalStack`): a private Redis holding the allocator's
journal, the allocator with a file:// shared KV store, two tiny-random
workers and the router. One has the credentials `pagedkv up` generates (a
token per worker bound to its id and address, the workers one store group
with its key, the router's token, an admin's, a journal key) and one more
worker token, an attacker's: a worker of another store group (`ATTACKER`,
bound to an address the bench holds); the other none (any caller may
register a pool, every pool shares the store unsealed: a development setup).

The victim runs in a process of its own for the whole run: a pool's decode
loop of Steps (`decode_steps`, one Step every 20 ms; with credentials it
registers with the admin token, the operator's) and a loop of greedy
completions through the router, each checked for the worker's text and the
`x-pagedkv-worker` header naming the real worker. The attacks run one after
the other (`pagedkv.bench.attackers`, the code the drills run), each after
`baseline_s` of the victim alone, from a caller with no token (and, for the
rogue pool, with worker-1's token too):

- rogue pool: pools advertising an attacker's server (whose identity route
  forges a proof, or relays the real worker's) and the real worker's
  address (under the real model's name and another's). Succeeded: the
  attacker's server was sent a completion or a credential.
- idle connections: to the allocator's HTTP port, sending nothing; its
  /metrics timed before they open and while they are open (`METRICS_PROBES`
  GETs, a new connection each). Succeeded: they took a thread each, or a
  /metrics GET failed or took over `METRICS_TARGET_S`.
- slow clients: heads and bodies on the router that never end. Succeeded:
  one was still open past its deadline (measured when the attack lasts that
  long), or /health failed.
- big /tokenize: one multi-megabyte text with its token strings at the
  worker. Succeeded: /health failed while it was answered.
- slow-read flood: many large pools keeping integrity checks in flight
  (its own process).
- snapshot amplification: one pool forked into thousands of sequences with
  the longest ids, while the allocator snapshots every `snapshot_every`
  records.
- snapshot watchers: `WatchEvents` streams each asking for the snapshot of a
  pool's cached blocks, read slowly.
- prompt reading: worker-1 is sent a salted tenant's prompt holding a
  secret; whoever reads the store's folder (the attacker) decodes every
  entry it finds without a key (and with its own group's key) and maps each
  decoded block's layer-0 V rows back to tokens with the public weights.
  Succeeded: a prompt token was recovered.
- store poisoning: the attacker's own pool plants forged entries for
  prompts worker-1 is then sent (admit, free, forged K/V under a valid
  header and checksum, the save confirmed), and, once worker-2 has computed
  other prompts, writes forged entries over every entry file of the store;
  worker-1 is then sent those. Succeeded: worker-1 loaded a forged entry
  (its shared-tier hit tokens) or answered other text than the same prompt
  computed under a fresh salt.
- store emptying: worker-2 computes prompts (saved to the store); the
  attacker's own pool reports every entry hash it reads off the store's
  folder as a load it refused; worker-1 is then sent those prompts.
  Succeeded: the store's index lost entries, or worker-1 loaded fewer of
  their tokens than worker-2 saved.
- evil worker: the attacker's pool at its address, proven to the router by a
  server of its own (`BadWorker`) serving a model of its own name (only the
  attack's requests go to it): `evil_answers` answers of `evil_answer_mb`
  at once, and a whole answer and a stream trickled a byte at a time after
  their status. Succeeded: the router's RSS grew by an answer's size, or a
  trickled answer was not ended (504, or an error event) within the
  router's first-byte timeout and `TRICKLE_SLACK_S`.

Every attack also succeeded if the victim lost a Step or a request while it
ran, or a process of the stack exited. Figures per attack and stack: the
victim's Step p99 and its router request p99 during the attack and in the
baseline before it, the allocator's peak RSS and thread count (psutil, read
every 50 ms), what was refused (for the store attacks: the entries worker-1
or the reader refused, by reason), and the attack's own details.
"""

from __future__ import annotations

import argparse

from pagedkv.bench import harness
from pagedkv.bench.attacks.drill import ATTACK_NAMES, measure
from pagedkv.bench.attacks.report import tables
from pagedkv.bench.workloads import ATTACKS

__all__ = ["add_arguments", "measure", "run", "tables"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_workload_option(p, ATTACKS)
    p.add_argument(
        "--attacks",
        type=harness.comma_list(list(ATTACK_NAMES)),
        default=list(ATTACK_NAMES),
        metavar="NAMES",
        help=f"the attacks to run, in this order (default all: {','.join(ATTACK_NAMES)})",
    )
    harness.add_json_option(p)


def run(args: argparse.Namespace) -> int:
    return harness.run("attacks", args, measure, tables)
