"""How many KV slots a request holds from its admission (`EngineConfig.kv_reservation`).

`paged` (the default): none ahead, blocks as the sequence grows. `max`: the
most tokens a sequence can have; `pow2`: the next power of two of prompt +
output; `oracle`: exactly prompt + output. Output is the request's
`max_tokens` (its length when it ignores EOS, as the benchmark's requests
do); no reservation passes `most` (the context length, or the KV pool when
smaller), which every prompt + `max_tokens` fits. The baselines and their
rules: docs/architecture.md, "Reservations at admission".
"""

from __future__ import annotations

RESERVATIONS = ("paged", "max", "pow2", "oracle")


def reserved_slots(mode: str, num_prompt_tokens: int, max_tokens: int, most: int) -> int:
    """The slots a request of `num_prompt_tokens` and `max_tokens` holds
    from its admission under `mode`; 0 for `paged` (none held ahead)."""
    wanted = num_prompt_tokens + max_tokens
    if mode == "paged":
        return 0
    if mode == "max":
        return most
    if mode == "pow2":
        return min(1 << (wanted - 1).bit_length(), most)
    if mode == "oracle":
        return wanted
    raise ValueError(f"unknown KV reservation {mode!r}: one of {', '.join(RESERVATIONS)}")
