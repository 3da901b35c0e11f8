"""Attacks on the shared store: forged K/V under a valid header and checksum, planted through the
protocol or written over existing entries, and entries read back into prompt tokens with the
public weights (layer 0's V of a token depends on the token alone)."""

from __future__ import annotations

from collections import Counter

from allocator_service.client.grpc_client import GrpcAllocator
from allocator_service.core import Admit


class PublicModel:
    """What anyone can compute from a public model (`model`, loaded on the CPU as a
    worker loads it): its fingerprint, the KV layout of a worker's pool of it with
    `block_size`, and each vocabulary token's layer-0 V (`values`, [vocab, kv heads
    x head dim]): K carries its position (RoPE), V does not."""

    def __init__(self, model: str, block_size: int) -> None:
        import torch

        from worker.model.loader import load_model
        from worker.tiers import KVLayout

        self.loaded = load_model(model)
        c, m = self.loaded.config, self.loaded.model
        self.layout = KVLayout(
            self.loaded.fingerprint,
            block_size,
            str(m.dtype).removeprefix("torch."),
            c.num_kv_heads,
            c.head_dim,
            c.num_layers,
        )
        with torch.inference_mode():
            layer = m.model.layers[0]
            _, _, v = layer.self_attn.qkv_proj(
                layer.input_layernorm(m.model.embed_tokens.weight)
            ).split(layer.self_attn.split, dim=-1)
        self.values = v.float()

    def forged_block(self, seed: int) -> bytes:
        """One block's payload of made-up K/V (normal values of about the size of real ones)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        kv = torch.randn(self.layout.block_shape, generator=gen) * 1.5
        return kv.to(self.layout.torch_dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def tokens_of(self, payload: bytes, tolerance: float = 1e-3) -> list[int | None]:
        """The token at each position of one block's payload whose layer-0 V it holds
        (None where no token's V is within `tolerance`, relatively: not a real block)."""
        import torch

        kv = torch.frombuffer(bytearray(payload), dtype=self.layout.torch_dtype).view(
            self.layout.block_shape
        )
        # V, layer 0: [positions, heads x dim]
        rows = kv[1, 0].reshape(self.layout.block_size, -1).float()
        dist = torch.cdist(rows, self.values)
        best, token = dist.min(dim=1)
        scale = self.values.norm(dim=1)[token] + 1.0
        return [
            int(t) if d <= tolerance * s else None
            for d, t, s in zip(best, token, scale, strict=True)
        ]


def plant_entries(pool: GrpcAllocator, prompts: list[list[int]], model: PublicModel, store) -> int:
    """A worker's own pool poisoning the store through the protocol: for each
    prompt (token ids others will send) admit it, free it (the allocator asks
    for its full blocks to be written through to the store), write forged K/V
    under a valid header (and checksum) for each, and confirm the saves. The
    entries confirmed (findable by every pool of the pool's store namespace)."""
    from allocator_service.core import Free
    from allocator_service.core.tiers import TierReport
    from worker.tiers import encode_entry, entry_key

    planted = 0
    for i, tokens in enumerate(prompts):
        if not pool.step([Admit(f"bait-{i}", tokens)]).all_ok:
            continue
        saves = list(pool.step([Free(f"bait-{i}")]).moves.store_saves)
        store.put_many(
            [
                (
                    entry_key(pool.store_namespace, h),
                    encode_entry(model.layout, h, model.forged_block(planted + j)),
                )
                for j, h in enumerate(saves)
            ]
        )
        pool.step([], TierReport([], [], saves, [], []))
        planted += len(saves)
    return planted


def refuse_entries(pool: GrpcAllocator, hashes: list[bytes]) -> None:
    """A worker's own pool reporting every hash in `hashes` as a store load it refused
    (a bad checksum), which drops an entry from the index every pool of its store
    namespace finds prefixes in, in one Step per 4,096 hashes."""
    from allocator_service.core.tiers import TierReport

    for i in range(0, len(hashes), 4096):
        pool.step([], TierReport([], [], [], [], hashes[i : i + 4096]))


def store_entries(root) -> list[tuple[object, str, bytes]]:
    """Every entry file of a file:// store's folder: (path, its store namespace, block hash)."""
    from pathlib import Path

    found = []
    for path in sorted(Path(root).rglob("*")):
        namespace, dash, hex_hash = path.name.rpartition("-")
        if path.is_file() and dash and not path.name.startswith(".") and len(hex_hash) == 64:
            found.append((path, namespace, bytes.fromhex(hex_hash)))
    return found


def overwrite_entries(root, model: PublicModel) -> int:
    """Whoever can write a file:// store's folder: every entry replaced by forged
    K/V under a valid header and checksum (plain: without a group's key nothing
    else can be written). The entries overwritten."""
    from worker.tiers import encode_entry

    entries = store_entries(root)
    for i, (path, _, block_hash) in enumerate(entries):
        path.write_bytes(encode_entry(model.layout, block_hash, model.forged_block(10_000 + i)))
    return len(entries)


def read_entries(root, model: PublicModel, seal=None) -> dict:
    """Whoever can read a file:// store's folder: each entry decoded (without a
    key, or with `seal`, a group's `StoreSeal`) and, where it opens, its tokens
    recovered from layer 0's V (`PublicModel.tokens_of`). {"entries": read,
    "decoded": opened, "refused": {reason: n}, "tokens": recovered, "blocks":
    the token ids of each entry every position of which was recovered}."""
    from worker.tiers import Refused, decode_entry

    refused: Counter[str] = Counter()
    decoded, tokens, blocks = 0, 0, []
    entries = store_entries(root)
    for path, namespace, block_hash in entries:
        got = decode_entry(
            path.read_bytes(), model.layout, block_hash, seal=seal, namespace=namespace
        )
        if isinstance(got, Refused):
            refused[got.reason] += 1
            continue
        decoded += 1
        ids = model.tokens_of(bytes(got))
        tokens += sum(t is not None for t in ids)
        if all(t is not None for t in ids):
            blocks.append(ids)
    return {
        "entries": len(entries),
        "decoded": decoded,
        "refused": dict(refused),
        "tokens": tokens,
        "blocks": blocks,
    }


def text_read_back(blocks: list[list[int]], tokenizer, secret: str) -> bool:
    """Whether `secret` (shorter than a block) is in the text of one recovered
    block or of two in a row (the order of blocks is not known: every pair)."""
    texts = [tokenizer.decode(b) for b in blocks]
    return any(secret in t for t in texts) or any(secret in a + b for a in texts for b in texts)
