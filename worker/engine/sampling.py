"""Sampling parameters and the batched sampler.

Greedy when temperature is 0; otherwise temperature, then top-k, then top-p
(nucleus) filtering, then a draw. A request with a `seed` draws from its own
generator, so its text does not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5
MAX_STOP = 16  # stop strings per request


class SamplingError(ValueError):
    """Bad sampling parameters (the HTTP layer answers 400)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context / pool limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: int = 0  # lower runs first and is preempted last

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens < 1):
            raise SamplingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature <= 100:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < -1:
            raise SamplingError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and type(self.seed) is not int:
            raise SamplingError("seed must be an integer")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop must be at most {MAX_STOP} non-empty strings")
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: the limit of
        # sampling at a vanishing temperature IS greedy decoding.
        return self.temperature < MIN_TEMPERATURE


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` [N, vocab]."""
    out: list[int] = []
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        # NOTE: argmax in float32 so fp16/bf16 ties break the same way as fp32.
        # All rows greedy (the common case): no row gather, which copies the
        # whole [N, vocab] block. `max(...).indices`, like argmax, picks the
        # first maximum, and is about twice as fast on the CPU.
        rows = logits if len(greedy_rows) == logits.shape[0] else logits[greedy_rows]
        picks = rows.float().max(dim=-1).indices.tolist()
        chosen = dict(zip(greedy_rows, picks, strict=True))
    else:
        chosen = {}
    for i, p in enumerate(params):
        if i in chosen:
            out.append(chosen[i])
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # Keep the smallest set whose mass reaches top_p (always >= 1 token).
            drop = cum - sorted_p >= p.top_p
            drop[0] = False  # top_p below float32's range still keeps the top token
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out
