"""The simulated device (`--device sim:NAME`): the GPU table, the roofline's
arithmetic, the pool sized from the simulated memory, deterministic tokens,
the virtual clock, and bad input refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.busy import BusyMeter
from worker.engine.llm_engine import RequestError
from worker.model.sim import load_sim_model
from worker.sim import GPUS, PUBLIC_CONFIGS, ModelShape, Roofline, SimConfigError, gpu, write_config

GIB = 1 << 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_config("llama-3-8b", tmp_path_factory.mktemp("llama-3-8b"))


def sim_engine(folder, device="sim:h100", **kw) -> LLMEngine:
    loaded = load_sim_model(folder)
    return LLMEngine(
        loaded, EngineConfig(model=str(folder), device=device, dtype=loaded.config.dtype, **kw)
    )


# -- the table -------------------------------------------------------------------------


def test_the_gpu_table_holds_the_datasheet_figures():
    figures = {
        name: (g.peak_flops, g.hbm_bytes_per_s, g.memory_bytes // GIB, g.host_bytes_per_s)
        for name, g in GPUS.items()
    }
    assert figures == {
        "h100": (989.4e12, 3.35e12, 80, 64e9),
        "h200": (989.4e12, 4.8e12, 141, 64e9),
        "a100-40gb": (312e12, 1.555e12, 40, 32e9),
        "a100-80gb": (312e12, 2.039e12, 80, 32e9),
        "l4": (121e12, 300e9, 24, 32e9),
    }
    with pytest.raises(
        ValueError, match="unknown simulated GPU 'b200'; known: h100, h200, a100-40gb"
    ):
        gpu("b200")


def test_public_configs_give_their_published_sizes():
    llama = ModelShape.from_config(PUBLIC_CONFIGS["llama-3-8b"])
    assert (llama.num_params, llama.dtype, llama.weight_bytes, llama.kv_bytes_per_token) == (
        8_030_261_248,
        "bfloat16",
        16_060_522_496,
        131_072,
    )
    opt = ModelShape.from_config(PUBLIC_CONFIGS["opt-13b"])
    # the reference article's figure: 819,200 KV bytes per token
    assert (opt.num_params, opt.dtype, opt.kv_bytes_per_token) == (
        12_853_473_280,
        "float16",
        819_200,
    )


# -- the roofline ------------------------------------------------------------------------


def test_a_decode_step_is_bandwidth_bound():
    # Llama-3-8B on an H100, one sequence decoding its token 1025 (1,024 cached; it attends to 1,025
    # keys): FLOPs = 2 x 6,979,584,000 (layers) + 2 x 525,336,576 (LM head) + 4 x 32 x 128 x 32 x
    # 1,025 (attention)       = 15,547,236,352; bytes = 16,060,522,496
    # (weights) + 131,072 x (1,025 read + 1 written)
    r = Roofline(gpu("h100"), ModelShape.from_config(PUBLIC_CONFIGS["llama-3-8b"]))
    cost = r.step([(1024, 1, 1)])
    assert cost.flops == 15_547_236_352
    assert cost.bytes == 16_195_002_368
    assert cost.bound == "memory"
    # 16,195,002,368 B / (3.35e12 B/s x 0.8) + 0.5 ms
    assert cost.seconds == pytest.approx(0.006542911, rel=1e-6)


def test_a_prefill_step_is_compute_bound():
    # 2,048 prompt tokens at once: FLOPs = 2 x 6,979,584,000 x 2,048 + 2 x 525,336,576
    #   + 524,288 x (2,048 x 2,049 / 2) = 29,689,475,235,840; 29.69e12 / (989.4e12 x 0.5) + 0.5 ms
    r = Roofline(gpu("h100"), ModelShape.from_config(PUBLIC_CONFIGS["llama-3-8b"]))
    cost = r.step([(0, 2048, 1)])
    assert cost.flops == 29_689_475_235_840
    assert cost.bytes == 16_597_393_408
    assert cost.bound == "compute"
    assert cost.seconds == pytest.approx(0.060515111, rel=1e-6)


def test_mfu_mbu_and_launch_cost_are_settable():
    shape = ModelShape.from_config(PUBLIC_CONFIGS["llama-3-8b"])
    base = Roofline(gpu("h100"), shape).step([(1024, 1, 1)])
    slower = Roofline(gpu("h100"), shape, mbu=0.4, launch_s=0.001).step([(1024, 1, 1)])
    assert slower.seconds == pytest.approx(2 * base.memory_s + 0.001)
    with pytest.raises(ValueError, match="MFU and MBU"):
        Roofline(gpu("h100"), shape, mfu=0)


def test_a_config_without_the_roofline_fields_is_refused():
    cfg = dict(PUBLIC_CONFIGS["llama-3-8b"])
    del cfg["intermediate_size"]
    with pytest.raises(SimConfigError, match="intermediate_size must be a positive integer"):
        ModelShape.from_config(cfg)
    with pytest.raises(SimConfigError, match="model_type 'bert' cannot be simulated"):
        ModelShape.from_config({**cfg, "model_type": "bert"})


# -- the pool ------------------------------------------------------------------------------


def test_the_pool_is_sized_from_the_simulated_memory(llama):
    engine = sim_engine(llama, kv_cache_memory="0.5")
    try:
        free = 80 * GIB - 16_060_522_496
        block = 131_072 * 16
        assert engine.kv_pool.num_blocks == int(0.5 * free) // block
        assert engine.kv_pool.bytes_total <= free
    finally:
        engine.close()


def test_an_fp8_pool_holds_twice_the_blocks_and_a_decode_reads_half_the_kv(llama):
    engines = {
        kv: sim_engine(llama, kv_cache_memory="0.5", kv_cache_dtype=kv) for kv in ("auto", "fp8")
    }
    try:
        auto, fp8 = engines["auto"], engines["fp8"]
        assert fp8.kv_pool.num_blocks == int(0.5 * (80 * GIB - 16_060_522_496)) // (65_536 * 16)
        assert fp8.kv_pool.num_blocks in (
            2 * auto.kv_pool.num_blocks,
            2 * auto.kv_pool.num_blocks + 1,
        )
        assert (
            str(fp8.kv_pool.dtype) == "torch.float8_e4m3fn"
            and "float8_e4m3fn" in fp8.kv_pool.describe()
        )
        assert fp8.runner.roofline.model.kv_bytes_per_token == 65_536
    finally:
        for engine in engines.values():
            engine.close()


def test_a_pool_that_does_not_fit_is_refused(llama):
    # An L4 has 24 GiB; 14.96 GiB go to the weights, so 4,629 blocks of 2 MiB fit.
    with pytest.raises(
        ValueError, match="does not fit in sim:l4's 24 GiB beside 15.0 GiB of weights"
    ):
        sim_engine(llama, device="sim:l4", num_blocks=10_000)


# -- tokens and clocks --------------------------------------------------------------------


PROMPTS = [list(range(1, 700)), [7] * 40, list(range(300, 0, -1))]


def test_outputs_are_a_function_of_the_tokens(llama):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    a, b = sim_engine(llama), sim_engine(llama, device="sim:a100-40gb", clock="virtual")
    try:
        together = [o.token_ids for o in a.generate(PROMPTS, params)]
        alone = [b.generate([p], params)[0].token_ids for p in PROMPTS]
    finally:
        a.close()
        b.close()
    assert together == alone
    assert len({tuple(t) for t in together}) == 3


def _served(engine, prompts, params, abort_at=None) -> dict[tuple[int, int], tuple[list[int], str]]:
    """Every sample's tokens and finish reason (request 0 aborted at step
    `abort_at`, and left out); then every block is back."""
    try:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final, steps = {}, 0
        while engine.has_unfinished():
            if steps == abort_at:
                engine.abort(ids[0])
            for out in engine.step():
                key = (ids.index(out.request_id), out.index)
                assert key not in final, f"an output after the last one of {key}"
                if out.finished:
                    final[key] = (out.token_ids, out.finish_reason)
            steps += 1
        engine.step()  # the last frees go out ...
        engine.step()  # ... and are answered
        assert engine.allocator.stats().used_blocks == 0
        assert engine.allocator.pool.integrity_problems() == []
        return {k: v for k, v in final.items() if abort_at is None or k[0] != 0}
    finally:
        engine.close()


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_overlapped_steps_give_the_synchronous_outputs(llama, caching):
    """On a sim: device each step is launched before the last one's tokens
    are processed, so a stop is found a step late (its extra token dropped):
    the same tokens and finish reasons as the synchronous engine, with
    stop tokens, one-token requests, parallel samples (forks), a shared
    prefix, an abort, and a pool small enough to preempt; with lookahead
    slots and without."""
    prompts = [list(range(1 + i, 20 + 8 * i)) for i in range(6)] + [list(range(1, 30)) + [5, 6]]
    base = SamplingParams(max_tokens=24, ignore_eos=True)
    first = sim_engine(llama, clock="virtual", async_scheduling=False)
    reference = _served(first, prompts, [base] * len(prompts))
    stops = [reference[0, 0][0][5], reference[2, 0][0][11]]  # tokens they sample: they stop there
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=stops)] * 3
    params += [
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=12, n=3, ignore_eos=True),
        base,
        SamplingParams(max_tokens=20, n=2, stop_token_ids=stops[:1]),
    ]
    small = {
        "num_blocks": 40,
        "block_size": 4,
        "enable_prefix_caching": caching,
        "clock": "virtual",
    }
    synchronous = sim_engine(llama, async_scheduling=False, num_lookahead_slots=0, **small)
    want = _served(synchronous, prompts, params)
    assert synchronous.num_preemptions > 0
    assert [want[k][1] for k in ((0, 0), (1, 0), (2, 0), (3, 0))] == [
        "stop",
        "length",
        "stop",
        "length",
    ]
    for lookahead in (0, 8):
        overlapped = sim_engine(llama, num_lookahead_slots=lookahead, **small)
        assert overlapped.overlapped
        assert _served(overlapped, prompts, params) == want, lookahead
        assert overlapped.num_preemptions > 0
        aborted = sim_engine(llama, num_lookahead_slots=lookahead, **small)
        assert _served(aborted, prompts, params, abort_at=4) == {
            k: v for k, v in want.items() if k[0] != 0
        }


def test_no_eos_unless_the_length_rule_says_so(tmp_path):
    cfg = {**PUBLIC_CONFIGS["llama-3-8b"], "vocab_size": 4, "eos_token_id": [0, 1]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = sim_engine(tmp_path, clock="virtual")
    try:
        outs = engine.generate([[2, 3, 2], [3, 3]], SamplingParams(max_tokens=40))
    finally:
        engine.close()
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 40
        assert set(out.token_ids) <= {2, 3}


def test_virtual_latencies_are_the_sum_of_device_times(llama):
    engine = sim_engine(llama, clock="virtual")
    try:
        out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        device = engine.runner.device_seconds
        e2e = engine.metrics.registry.get_sample_value(
            "pagedkv_worker_e2e_request_latency_seconds_sum", engine.metrics.labels
        )
        launch = engine.runner.roofline.launch_s
        assert len(out.token_ids) == 32
        assert abs(e2e - device) <= launch
        assert engine.clock.now() == pytest.approx(device)
        # 32 steps: a prefill of 699 tokens, then 31 decodes of about 6.5 ms each
        assert device == pytest.approx(
            sum(engine.runner.roofline.step([(0, 699, 1)]).seconds for _ in [0])
            + sum(engine.runner.roofline.step([(699 + i, 1, 1)]).seconds for i in range(31))
        )
        busy = engine.metrics.registry.get_sample_value(
            "pagedkv_worker_device_busy_ratio", engine.metrics.labels
        )
        assert busy == 1.0  # on the virtual clock only device time passes
        busy_s = engine.metrics.registry.get_sample_value(
            "pagedkv_worker_device_busy_seconds", engine.metrics.labels
        )
        assert busy_s == pytest.approx(device)  # every step's device time, whole
    finally:
        engine.close()


def test_busy_time_counts_a_queued_step_as_it_computes():
    """A step launched behind another is recorded whole at its launch; the
    device time up to now counts only what it has computed."""
    now = [0.0]
    meter = BusyMeter(lambda: now[0])
    meter.record(0.0, 1.0)
    meter.record(1.0, 3.0)  # queued behind the first
    now[0] = 2.0
    assert meter.computed() == 2.0 and meter.ratio() == 1.0
    now[0] = 4.0
    assert meter.computed() == 3.0 and meter.ratio() == 0.75


def test_concurrent_requests_wait_for_each_others_steps(llama):
    engine = sim_engine(llama, clock="virtual")
    try:
        engine.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
        device = engine.runner.device_seconds
        labels = engine.metrics.labels
        e2e_sum = engine.metrics.registry.get_sample_value(
            "pagedkv_worker_e2e_request_latency_seconds_sum", labels
        )
        # each request lived through at most every step, and the last one through all of them
        assert device - engine.runner.roofline.launch_s <= e2e_sum <= 3 * device
    finally:
        engine.close()


def test_host_time_is_measured_by_part(llama):
    engine = sim_engine(llama)
    try:
        engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
        get = engine.metrics.registry.get_sample_value
        for part in ("schedule", "allocator_wait", "sample", "output"):
            assert (
                get(
                    "pagedkv_worker_step_host_seconds_count",
                    {**engine.metrics.labels, "part": part},
                )
                >= 8
            )
        assert 0 < get("pagedkv_worker_device_busy_ratio", engine.metrics.labels) <= 1
    finally:
        engine.close()


def test_logprobs_are_refused_on_a_simulated_device(llama):
    engine = sim_engine(llama)
    try:
        with pytest.raises(RequestError, match="computes no logits"):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
        with pytest.raises(RequestError, match="no tokenizer"):
            engine.add_request("a text prompt", SamplingParams(max_tokens=2))
    finally:
        engine.close()


# -- the command line ------------------------------------------------------------------------


def _worker(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (
            None,
            ["--device", "sim:b200"],
            "unknown simulated GPU 'b200'; known: h100, h200, a100-40gb, a100-80gb, l4",
        ),
        (
            "drop",
            ["--device", "sim:h100"],
            "config.json: num_attention_heads must be a positive integer",
        ),
        (None, ["--device", "sim:l4", "--num-blocks", "100000"], "does not fit in sim:l4's 24 GiB"),
        # the host tier's slots are counted as on CUDA: 2 MiB blocks (16 tokens of 131,072 B)
        (
            None,
            ["--device", "sim:h100", "--kv-offloading-size", "0.001"],
            "--kv-offloading-size 0.001 GiB holds no KV block (2097152 B each)",
        ),
        (
            None,
            [
                "--device",
                "sim:h100",
                "--kv-offloading-size",
                "0.001953125",
                "--preemption-mode",
                "swap",
            ],
            "holds 1 block(s): too few for --preemption-mode swap",
        ),
        (
            None,
            ["--device", "sim:h100", "--preemption-mode", "swap"],
            "--preemption-mode swap needs a host tier",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, args, message):
    cfg = dict(PUBLIC_CONFIGS["llama-3-8b"])
    if make == "drop":
        del cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    done = _worker(str(tmp_path), *args, "--port", "0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
