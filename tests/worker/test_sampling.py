"""Sampling with vLLM's semantics, against transformers on the same tiny random
checkpoint, and parallel sampling (n > 1) on forked blocks."""

from __future__ import annotations

import json

import pytest
import torch

from tests.worker.test_model import _save_checkpoint
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model.loader import load_model

transformers = pytest.importorskip("transformers")
PROMPT = [5, 17, 3, 44, 9, 60, 23, 71, 12, 30]  # 10 tokens: 2 full blocks of 4 and a partial one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = _save_checkpoint("llama", folder)
    return hf, load_model(folder)


def engine_of(loaded, **kw) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**{"num_blocks": 128, "block_size": 4, **kw}))


def hf_greedy(
    hf, prompt: list[int], steps: int, processors=(), stop: int | None = None
) -> list[int]:
    """Greedy decoding with transformers' logits processors, token by token."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    procs = transformers.LogitsProcessorList(processors)
    with torch.no_grad():
        for _ in range(steps):
            scores = procs(ids, hf(ids).logits[:, -1, :].float())
            tok = int(scores.argmax(-1))
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            if tok == stop:
                break
    return out


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's (and vLLM's) frequency and presence penalties over the generated tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


GREEDY = dict(temperature=0, ignore_eos=True, max_tokens=12)


def test_logprobs_are_log_softmax_of_the_logits(checkpoint):
    hf, loaded = checkpoint
    out = engine_of(loaded).generate([PROMPT], SamplingParams(**GREEDY, logprobs=5))[0]
    assert len(out.logprobs) == 12
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1 : -1]
    for pos, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp.token_id == tok and lp.rank == 1  # greedy: the most likely
        assert abs(lp.logprob - ref[pos, tok].item()) < 1e-4
        top_v, top_i = ref[pos].topk(5)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert max(abs(a - b) for (_, a), b in zip(lp.top, top_v.tolist(), strict=True)) < 1e-4


def test_sampled_logprobs_are_of_the_raw_logits(checkpoint):
    """vLLM's default (raw logprobs): temperature and penalties do not change them."""
    _, loaded = checkpoint
    engine = engine_of(loaded)
    plain = engine.generate([PROMPT], SamplingParams(**GREEDY, logprobs=0))[0]
    hot = engine.generate(
        [PROMPT],
        SamplingParams(max_tokens=1, temperature=5.0, seed=1, logprobs=0, repetition_penalty=1.5),
    )[0]
    first = hot.logprobs[0]
    assert first.token_id == hot.token_ids[0] and first.top == []
    if hot.token_ids[0] == plain.token_ids[0]:
        assert abs(first.logprob - plain.logprobs[0].logprob) < 1e-5


@pytest.mark.parametrize(
    "case", ["repetition", "frequency", "presence", "logit_bias", "min_tokens"]
)
def test_processors_match_transformers_greedy(checkpoint, case):
    hf, loaded = checkpoint
    plain = hf_greedy(hf, PROMPT, 12)
    stop = None
    if case == "repetition":
        kw, procs = (
            {"repetition_penalty": 1.8},
            [transformers.RepetitionPenaltyLogitsProcessor(1.8)],
        )
    elif case == "frequency":
        kw, procs = {"frequency_penalty": 1.5}, [OpenAIPenalties(len(PROMPT), 1.5, 0.0)]
    elif case == "presence":
        kw, procs = {"presence_penalty": 1.5}, [OpenAIPenalties(len(PROMPT), 0.0, 1.5)]
    elif case == "logit_bias":
        target = (plain[0] + 7) % 96
        kw = {"logit_bias": ((target, 3.0), (plain[0], -2.0))}
        procs = [transformers.SequenceBiasLogitsProcessor({(target,): 3.0, (plain[0],): -2.0})]
    else:  # the first greedy token stops the sequence, but not before 4 tokens
        stop = plain[0]
        kw = {"min_tokens": 4, "stop_token_ids": (stop,)}
        procs = [transformers.MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, [stop])]
    expected = hf_greedy(hf, PROMPT, 12, procs, stop)
    assert expected != plain  # the control changes the answer
    got = engine_of(loaded).generate([PROMPT], SamplingParams(**{**GREEDY, **kw}))[0]
    assert got.token_ids == expected
    if case == "min_tokens" and expected[-1] == stop:
        assert got.finish_reason == "stop" and got.stop_reason == stop


def test_min_p_and_seed_are_reproducible(checkpoint):
    _, loaded = checkpoint
    engine = engine_of(loaded)
    params = SamplingParams(max_tokens=10, temperature=1.0, min_p=0.3, seed=11, ignore_eos=True)
    a, b = (engine.generate([PROMPT], params)[0].token_ids for _ in range(2))
    assert a == b


# -- parallel sampling: n samples as forks of one computed prompt ---------------------------


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_n4_shares_prompt_blocks_and_copies_the_partial_one(checkpoint, ahead):
    _, loaded = checkpoint
    # (no lookahead slots: the blocks held are exactly those of the tokens)
    engine = engine_of(loaded, async_scheduling=ahead, num_lookahead_slots=0)
    pool = engine.allocator.pool
    engine.add_request(PROMPT, SamplingParams(**GREEDY, n=4), "r")
    engine.step()  # the prompt, once; four first tokens from its logits
    assert engine.metrics.prompt_tokens._value.get() == len(PROMPT)
    parent_table = list(engine._seqs["r"][0].block_table)
    assert len(parent_table) == 3
    if not ahead:
        assert list(pool.tables().values()) == [parent_table]
        copies_before = pool.copies
        engine.step()  # four forks, then four appends into the shared partial block
    else:
        # The next step's call went out before this step computed (the
        # embedded core answers at once): it forked the four samples and
        # reserved each one's first-token slot in the shared partial block.
        copies_before = 0
    tables = pool.tables()
    assert len(tables) == 4
    refs = pool.refcounts()
    full = parent_table[:2]
    assert [refs[b] for b in full] == [4, 4]  # every full prompt block shared by the 4 samples
    assert all(t[:2] == full for t in tables.values())
    lasts = {t[2] for t in tables.values()}
    assert len(lasts) == 4  # each sample writes its own copy of the partial block...
    # ...3 copies on write, the last writer keeps the original
    assert pool.copies - copies_before == 3
    assert parent_table[2] in lasts
    # memory: the prompt's full blocks once plus each sample's own tail
    for _ in range(5):
        engine.step()
    seqs = engine._seqs["r"]
    # stored: all but the last token (async: the last one's slot too, reserved ahead)
    # past the 8 shared
    own = sum(-(-(len(s.token_ids) - (0 if ahead else 1) - 8) // 4) for s in seqs)
    assert engine.allocator.stats().used_blocks == 2 + own
    while engine.has_unfinished():
        engine.step()
    engine.step()  # (async: the last frees are collected)
    assert engine.allocator.stats().used_blocks == 0 and pool.integrity_problems() == []


def test_n4_greedy_equals_n1_and_seeded_samples_reproduce(checkpoint):
    _, loaded = checkpoint
    engine = engine_of(loaded)
    one = engine.generate([PROMPT], SamplingParams(**GREEDY))[0].token_ids
    four = engine.generate_samples([PROMPT], SamplingParams(**GREEDY, n=4))[0]
    assert [o.token_ids for o in four] == [one] * 4 and [o.index for o in four] == [0, 1, 2, 3]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, n=4)
    a = [o.token_ids for o in engine.generate_samples([PROMPT], seeded)[0]]
    b = [o.token_ids for o in engine_of(loaded).generate_samples([PROMPT], seeded)[0]]
    assert a == b and len({tuple(t) for t in a}) > 1
    # sample i is seeded seed + i (vLLM): sample 1 of seed 5 is sample 0 of seed 6
    six = engine.generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True)
    )[0]
    assert a[1] == six.token_ids


@pytest.mark.parametrize("max_tokens", [1, 9])
def test_forked_families_survive_preemption(checkpoint, max_tokens):
    """A tiny pool: samples are preempted and recomputed; every sample still
    equals greedy n = 1, and every block comes back."""
    _, loaded = checkpoint
    prompts = [PROMPT, PROMPT[:7] + [88], [40 + i for i in range(13)]]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    ref = [o.token_ids for o in engine_of(loaded).generate(prompts, params)]
    for caching in (False, True):
        engine = engine_of(loaded, num_blocks=14, enable_prefix_caching=caching)
        outs = engine.generate_samples(
            prompts, SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, n=4)
        )
        assert [[o.token_ids for o in per] for per in outs] == [[r] * 4 for r in ref]
        engine.step()
        assert engine.allocator.stats().used_blocks == 0
        assert engine.allocator.pool.integrity_problems() == []
        if max_tokens > 1:
            assert engine.num_preemptions > 0


def test_abort_frees_every_sample(checkpoint):
    _, loaded = checkpoint
    engine = engine_of(loaded)
    engine.add_request(PROMPT, SamplingParams(**GREEDY, n=3), "r")
    for _ in range(3):
        engine.step()
    engine.abort("r")
    engine.step()
    assert engine.allocator.stats().used_blocks == 0 and not engine.has_unfinished()


# -- defaults from the model's generation_config.json ---------------------------------------


def test_generation_config_gives_sampling_defaults(tmp_path):
    from types import SimpleNamespace

    from pagedkv_base.api.protocol import CompletionRequest
    from worker.server.app import _sampling_params

    _save_checkpoint("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 50,
                "repetition_penalty": 1.1,
                "do_sample": True,
                "eos_token_id": 2,
            }
        )
    )
    loaded = load_model(tmp_path)
    assert loaded.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    core = SimpleNamespace(loaded=loaded)
    req = CompletionRequest(model="m", prompt="t1")
    p = _sampling_params(req, 4, "m", core, None)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 0, 1.1)
    req = CompletionRequest(model="m", prompt="t1", temperature=0, top_p=1.0)
    p = _sampling_params(req, 4, "m", core, None)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0, 1.0, 1.1)  # the request wins


# -- prompt logprobs: the logits of every prompt position -----------------------------------


def _assert_prompt_logprobs(hf, prompt: list[int], lps, k: int) -> None:
    """`lps` equal log_softmax of transformers' logits at each prompt position."""
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    # the first token has no logprob (OpenAI, vLLM)
    assert len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        lp, row = lps[pos], ref[pos - 1]
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - row[prompt[pos]].item()) < 1e-4
        assert lp.rank == int((row > row[prompt[pos]]).sum()) + 1
        top_v, top_i = row.topk(k)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert (
            max((abs(a - b) for (_, a), b in zip(lp.top, top_v.tolist(), strict=True)), default=0)
            < 1e-4
        )


LONG = [(7 * i + 3) % 97 for i in range(23)]  # 23 tokens: 5 full blocks of 4 and a partial one


# whole prompts; chunks across and on block edges
@pytest.mark.parametrize("batched_tokens", [2048, 5, 4])
def test_prompt_logprobs_are_log_softmax_at_every_position(checkpoint, batched_tokens, monkeypatch):
    hf, loaded = checkpoint
    if batched_tokens > len(LONG):  # whole prompts: their logits in slices of 3 rows
        monkeypatch.setattr("worker.engine.model_runner.PROMPT_LOGITS_ROWS", 3)
    engine = engine_of(loaded, max_num_batched_tokens=batched_tokens)
    plain = engine.generate([LONG, PROMPT], SamplingParams(**GREEDY))
    outs = engine.generate([LONG, PROMPT], SamplingParams(**GREEDY, prompt_logprobs=3))
    for prompt, out, ref in zip([LONG, PROMPT], outs, plain, strict=True):
        _assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 3)
        assert out.token_ids == ref.token_ids  # the generated tokens do not change
    assert engine.allocator.stats().used_blocks == 0


def test_prompt_logprobs_ignore_the_prefix_cache(checkpoint):
    """With prefix caching on, a prompt another request cached is computed
    again (its own salt): every position's logprobs, still correct; the
    request after it shares nothing with it either."""
    hf, loaded = checkpoint
    engine = engine_of(loaded, enable_prefix_caching=True, max_num_batched_tokens=6)
    first = engine.generate([LONG], SamplingParams(**GREEDY))[0]
    again = engine.generate([LONG], SamplingParams(**GREEDY))[0]
    assert again.num_cached_tokens == 20  # the cache is on and holds the prompt
    out = engine.generate([LONG], SamplingParams(**GREEDY, prompt_logprobs=2, cache_salt="tenant"))[
        0
    ]
    assert out.num_cached_tokens == 0 and out.token_ids == first.token_ids
    _assert_prompt_logprobs(hf, LONG, out.prompt_logprobs, 2)
    both = engine.generate([LONG, LONG], SamplingParams(**GREEDY, prompt_logprobs=0, n=2))
    for o in both:
        assert o.num_cached_tokens == 0
        _assert_prompt_logprobs(hf, LONG, o.prompt_logprobs, 0)
    assert engine.allocator.pool.integrity_problems() == []


def test_prompt_logprobs_survive_preemption_and_n(checkpoint):
    """A tiny pool preempts mid-prompt and after it: each position's logprobs
    once, correct; every sample of n = 3 carries the request's prompt logprobs."""
    hf, loaded = checkpoint
    prompts = [LONG, PROMPT, LONG[:9]]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=9, prompt_logprobs=1, n=3)
    ref = [
        o.token_ids
        for o in engine_of(loaded).generate(prompts, SamplingParams(**{**GREEDY, "max_tokens": 9}))
    ]
    for caching in (False, True):
        engine = engine_of(
            loaded, num_blocks=12, max_num_batched_tokens=8, enable_prefix_caching=caching
        )
        outs = engine.generate_samples(prompts, params)
        assert engine.num_preemptions > 0
        for prompt, per, r in zip(prompts, outs, ref, strict=True):
            assert [o.token_ids for o in per] == [r] * 3
            for o in per:
                _assert_prompt_logprobs(hf, prompt, o.prompt_logprobs, 1)


def test_max_num_seqs_counts_every_sample(checkpoint):
    _, loaded = checkpoint
    engine = engine_of(loaded, max_num_seqs=4)
    for i in range(3):
        engine.add_request(PROMPT[: 5 + i], SamplingParams(**GREEDY, n=3), f"r{i}")
    most = 0
    while engine.has_unfinished():
        engine.step()
        live = len(engine.scheduler.running) + len(engine.scheduler.forking)
        most = max(most, live)
        assert live <= 4
    assert most == 3  # one family of 3 at a time: a second would make 6
    from worker.engine import RequestError

    with pytest.raises(RequestError, match="max_num_seqs"):
        engine.add_request(PROMPT, SamplingParams(**GREEDY, n=5))
