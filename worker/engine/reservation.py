"""How many KV slots a request holds from its admission (`EngineConfig.kv_reservation`).

`paged` (the default) holds only what a step computes: blocks come as the
sequence grows. The other modes are the servers before paging, kept as
baselines the benchmark compares with (`pagedkv bench reservation`): each
request holds one reservation from its admission to its end, and every
token it computes lands inside it.

- `max`: the most tokens a sequence can have (FasterTransformer, Orca (Max));
- `pow2`: the next power of two of prompt + output (Orca (Pow2));
- `oracle`: exactly prompt + output (Orca (Oracle)).

Output is the request's `max_tokens`: its output length when it ignores
EOS, as the benchmark's requests do. No reservation passes the most
slots a sequence can hold (`most`: the context length, or the KV pool
when smaller), which every prompt + `max_tokens` fits.
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
