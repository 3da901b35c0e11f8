"""What the KV tiers' byte tests share (tests/worker/test_tiers_bytes.py,
test_tiers_store.py, test_peer_store.py): a small KV pool of random K/V in every dtype,
a block's raw bytes, block hashes, a fingerprint of its own, the tier metrics, and the
repository root (for a second process)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from worker.kv_pool import KVPool
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float16, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
SHAPE = dict(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8)


def make_pool(dtype: torch.dtype = torch.float16, seed: int = 0, device: str = "cpu") -> KVPool:
    """A small KV pool whose every block holds distinct random K/V."""
    pool = KVPool(**SHAPE, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    pool.k_blocks.copy_(torch.randn(pool.k_blocks.shape, generator=g).to(dtype))
    pool.v_blocks.copy_(torch.randn(pool.v_blocks.shape, generator=g).to(dtype))
    return pool


def block_bytes(pool: KVPool, block: int) -> bytes:
    """Block `block`'s K then V of every layer, as raw bytes (the payload layout)."""
    kv = torch.stack((pool.k_blocks[:, block], pool.v_blocks[:, block])).cpu().contiguous()
    return kv.view(torch.uint8).numpy().tobytes()


def hashes(n: int, tag: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def fingerprint() -> str:
    """A model fingerprint of its own, so tests sharing one Redis never share keys."""
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


def sample(metrics: WorkerMetrics, name: str, tier: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(
        f"pagedkv_worker_kv_tier_{name}", {**metrics.labels, "tier": tier, **labels}
    )


def new_metrics() -> WorkerMetrics:
    return WorkerMetrics("w-1", "tiny", registry=CollectorRegistry())
