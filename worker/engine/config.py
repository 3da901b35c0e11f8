"""Engine settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from allocator_service.core.limits import MAX_BLOCK_SIZE
from worker.engine.reservation import RESERVATIONS
from worker.kv_bytes import WORKER_DTYPES, check_kv_cache_dtype
from worker.sim import CLOCKS, DEFAULT_LAUNCH_S, DEFAULT_MBU, DEFAULT_MFU, is_sim

# more slots ahead would hold blocks for long without saving more calls
MAX_LOOKAHEAD_SLOTS = 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "tiny-random"
    # the name clients send; the `model_name` label of the metrics (default: `model`)
    served_model_name: str | None = None
    allocator: str = "embedded"  # or HOST:PORT of the allocator service
    worker_id: str = "worker-0"
    num_blocks: int | None = None  # exactly this many blocks, or
    kv_cache_memory: str | None = None  # a budget ("2GiB"; on CUDA "0.5" = half of free memory)
    block_size: int = 16
    enable_prefix_caching: bool = False
    # Send step N+1's allocator call while step N computes (scheduler.py).
    async_scheduling: bool = True
    # A call holds a sampling sequence's slots this far past its next token,
    # so the steps after it make no call until one runs out (lookahead.py).
    num_lookahead_slots: int = 8
    # KV tiers (worker/engine/tiers.py): GiB of host memory below the KV pool
    # (0: none), whether to use the allocator's shared store when it has
    # one, and what a preempted sequence's K/V becomes ("recompute", "swap").
    kv_offloading_size: float = 0.0
    kv_shared_store: bool = True
    # The store group's secret (--kv-store-key-file): entries this worker
    # writes are sealed with it and it loads only entries sealed with it
    # (worker/tiers/seal.py); None: plain entries.
    kv_store_key: bytes | None = field(default=None, repr=False)
    preemption_mode: str = "recompute"
    # Its part in prefill/decode disaggregation (`--kv-role`: both, prefill, decode),
    # registered with the pool; prefill and decode move blocks through the shared store.
    kv_role: str = "both"
    # With a peer:// store: the most seconds one step waits for its pulls, all writers together.
    kv_peer_pull_timeout_s: float = 1.0
    # KV slots a request holds from its admission (reservation.py): "paged"
    # (none ahead: blocks as it grows), or a baseline of the servers before
    # paging, "max", "pow2" or "oracle" (a benchmark setting, not a flag).
    kv_reservation: str = "paged"
    device: str = "cpu"  # cpu, cuda[:N] or sim:NAME (a simulated GPU: worker/engine/sim_runner.py)
    dtype: str = "float32"
    # The KV pool's element type (`--kv-cache-dtype`): "auto"
    # (`dtype`) or an fp8 format (worker/kv_quant.py).
    kv_cache_dtype: str = "auto"
    # The engine's clock: "wall", or on a simulated device "virtual" (only device time passes).
    clock: str = "wall"
    # The simulated device's roofline (worker/sim/roofline.py): shares of the peak FLOP/s and
    # HBM bandwidth a step reaches, and the fixed cost of launching one.
    sim_mfu: float = DEFAULT_MFU
    sim_mbu: float = DEFAULT_MBU
    sim_launch_ms: float = DEFAULT_LAUNCH_S * 1e3
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's
    allocator_token: str | None = None  # bearer token for the allocator service
    allocator_tls_ca: str | None = None
    # A remote allocator that has not answered for this long: /health says 503 ...
    allocator_unhealthy_after_s: float = 10.0
    # ... and for this long: requests waiting on it fail, new ones are refused.
    allocator_give_up_after_s: float = 120.0
    # Registered with the pool so a router finds this worker: its HTTP URL
    # as others reach it (empty: not advertised; the served model name goes too).
    advertise_url: str = ""

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("--num-blocks must be positive")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"--block-size must be in [1, {MAX_BLOCK_SIZE}]")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be positive")
        if not 0 <= self.num_lookahead_slots <= MAX_LOOKAHEAD_SLOTS:
            raise ValueError(f"--num-lookahead-slots must be in [0, {MAX_LOOKAHEAD_SLOTS}]")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        if not self.allocator_unhealthy_after_s > 0 or not self.allocator_give_up_after_s > 0:
            raise ValueError(
                "PAGEDKV_WORKER_ALLOCATOR_UNHEALTHY_AFTER and "
                "PAGEDKV_WORKER_ALLOCATOR_GIVE_UP_AFTER must be positive"
            )
        if not 0 < self.kv_peer_pull_timeout_s < float("inf"):
            raise ValueError("PAGEDKV_WORKER_KV_PEER_PULL_TIMEOUT must be a positive number")
        if self.advertise_url and not self.advertise_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--advertise-url must be an http:// or https:// URL, got {self.advertise_url!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}"
            )
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError(
                "--kv-offloading-size needs prefix caching (the tiers keep blocks by their hash)"
            )
        if self.preemption_mode == "swap" and not self.kv_offloading_size:
            raise ValueError("--preemption-mode swap needs a host tier (--kv-offloading-size GIB)")
        if self.kv_role != "both" and not (self.kv_shared_store and self.enable_prefix_caching):
            raise ValueError(
                f"--kv-role {self.kv_role} needs the allocator's shared store and prefix caching "
                "(the prompt's blocks move through the store): drop --no-kv-shared-store and "
                "--no-enable-prefix-caching"
            )
        if self.kv_reservation not in RESERVATIONS:
            raise ValueError(
                "kv_reservation must be one of "
                f"{', '.join(RESERVATIONS)}, got {self.kv_reservation!r}"
            )
        if self.kv_reservation != "paged" and self.enable_prefix_caching:
            raise ValueError(
                f"kv_reservation {self.kv_reservation!r} models a server without a prefix cache: "
                "turn prefix caching off"
            )
        if self.clock not in CLOCKS:
            raise ValueError(f"--clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if self.clock == "virtual" and not is_sim(self.device):
            raise ValueError("--clock virtual needs a simulated device (--device sim:NAME)")
        if not 0 < self.sim_mfu <= 1 or not 0 < self.sim_mbu <= 1:
            raise ValueError("--sim-mfu and --sim-mbu must be in (0, 1]")
        if not 0 <= self.sim_launch_ms < float("inf"):
            raise ValueError("--sim-launch-ms must be >= 0")
        if self.dtype not in WORKER_DTYPES:
            raise ValueError("--dtype must be float32, float16 or bfloat16")
        check_kv_cache_dtype(self.kv_cache_dtype)
