"""Sampling parameters and the batched sampler, with vLLM's semantics.

Per row, in vLLM v1's order: the logprobs the client asked for are taken from
the RAW logits (log_softmax of the model's output, vLLM's default
`raw_logprobs`); then `logit_bias` and `min_tokens` (the stop and eos tokens
are impossible until `min_tokens` tokens were generated); then the penalties
(`repetition_penalty` over prompt and output tokens, then `frequency_penalty`
and `presence_penalty` over the output tokens); then greedy (temperature 0)
takes the argmax, or temperature, `min_p`, top-k and top-p filter and a token
is drawn. A request with a `seed` draws from its own generator, so its text
does not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

MIN_TEMPERATURE = 1e-5
MAX_STOP = 16  # stop strings per request
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default --max-logprobs)
MAX_N = 128  # samples per prompt
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)


class SamplingError(ValueError):
    """Bad sampling parameters (the HTTP layer answers 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _number(value: object) -> bool:
    # not NaN
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context / pool limit
    n: int = 1  # samples of the prompt: the others are forks of the first in the allocator
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top logprobs per generated token (0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    cache_salt: str | None = None
    priority: int = 0  # lower runs first and is preempted last

    def __post_init__(self) -> None:
        def bad(param: str, why: str) -> SamplingError:
            return SamplingError(f"{param} {why}", param)

        if self.max_tokens is not None and (
            type(self.max_tokens) is not int or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if type(self.n) is not int or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _number(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
            type(t) is not int or t < 0 or not _number(b) or not -100 <= b <= 100
            for t, b in self.logit_bias
        ):
            raise bad(
                "logit_bias",
                f"must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
            )
        if type(self.min_tokens) is not int or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and type(self.seed) is not int:
            raise bad("seed", "must be an integer")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", f"must be at most {MAX_STOP} non-empty strings")
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: the limit of
        # sampling at a vanishing temperature IS greedy decoding.
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of n: vLLM's `seed + index`, so
        seeded samples differ from one another and are reproducible."""
        if index == 0 or self.seed is None:
            return self
        from dataclasses import replace

        return replace(self, seed=self.seed + index)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


class Row(Protocol):
    """What the sampler reads of a sequence (worker.engine.sequence.Sequence)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...


class Logprobs(NamedTuple):
    """One position's logprobs: the chosen token's, its rank (1 = the most
    likely) and the top ones, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def logprobs_of(logprobs: torch.Tensor, chosen: Sequence[int], k: int) -> list[Logprobs]:
    """Logprobs rows [N, vocab] (already log_softmax) -> one `Logprobs` per row."""
    picked = logprobs.gather(1, torch.tensor(chosen, device=logprobs.device).unsqueeze(1)).squeeze(
        1
    )
    ranks = (logprobs > picked.unsqueeze(1)).sum(dim=1) + 1
    if k:
        top_v, top_i = logprobs.topk(k, dim=-1)
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in chosen]
    return [
        Logprobs(t, lp, r, top)
        for t, lp, r, top in zip(chosen, picked.tolist(), ranks.tolist(), tops, strict=True)
    ]


def _process(row: torch.Tensor, seq: Row, stop_ids: frozenset[int]) -> torch.Tensor:
    """logit_bias, min_tokens and the penalties on one float32 row (a copy)."""
    p = seq.params
    row = row.clone()
    vocab = row.numel()
    if p.logit_bias:
        ids = torch.tensor(
            [t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=row.device
        )
        bias = torch.tensor(
            [b for t, b in p.logit_bias if t < vocab], dtype=row.dtype, device=row.device
        )
        row.index_add_(0, ids, bias)
    out_ids = seq.output_token_ids
    if p.min_tokens and len(out_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else stop_ids)
        banned = [t for t in banned if t < vocab]
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(seq.prompt_token_ids) | set(out_ids)), dtype=torch.long, device=row.device
        )
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and out_ids:
        counts = torch.bincount(
            torch.tensor(out_ids, dtype=torch.long, device=row.device), minlength=vocab
        )[:vocab]
        row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(
            row.dtype
        )
    return row


def sample(
    logits: torch.Tensor,
    seqs: Sequence[Row],
    stop_ids: frozenset[int] = frozenset(),
) -> tuple[list[int], list[Logprobs | None]]:
    """One token per row of `logits` [N, vocab] (row i for `seqs[i]`), and
    the logprobs of the rows whose parameters ask for them. `stop_ids`: the
    model's eos tokens (`min_tokens` holds them back)."""
    params = [s.params for s in seqs]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = torch.log_softmax(logits[want].float(), dim=-1) if want else None
    chosen: dict[int, int] = {}
    plain_greedy = [i for i, p in enumerate(params) if p.greedy and not p.penalised]
    if plain_greedy:
        # NOTE: argmax in float32 so fp16/bf16 ties break the same way as fp32.
        # All rows greedy (the common case): no row gather, which copies the
        # whole [N, vocab] block. `max(...).indices`, like argmax, picks the
        # first maximum, and is about twice as fast on the CPU.
        rows = logits if len(plain_greedy) == logits.shape[0] else logits[plain_greedy]
        picks = rows.float().max(dim=-1).indices.tolist()
        chosen = dict(zip(plain_greedy, picks, strict=True))
    for i, seq in enumerate(seqs):
        if i in chosen:
            continue
        p = params[i]
        row = logits[i].float()
        if p.penalised:
            row = _process(row, seq, stop_ids)
        if p.greedy:
            chosen[i] = int(row.max(dim=-1).indices.item())
            continue
        row = row / p.temperature
        if p.min_p > 0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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
        chosen[i] = int(torch.multinomial(probs, 1, generator=seqs[i].generator).item())
    tokens = [chosen[i] for i in range(len(seqs))]
    out: list[Logprobs | None] = [None] * len(seqs)
    if want:
        k = max(params[i].logprobs or 0 for i in want)
        for i, lp in zip(want, logprobs_of(raw, [tokens[i] for i in want], k), strict=True):
            out[i] = lp._replace(top=lp.top[: params[i].logprobs])
    return tokens, out
