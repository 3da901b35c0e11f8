"""The systems the benchmarks compare, each written once.

- `allocators`: the allocator in-process, over gRPC, over gRPC with a Redis
  journal (`bench allocator`, `bench serve --allocator`); a KV event follower.
- `engine`: this engine (`LLMEngine`) generating a workload, with any
  allocator, scheduling and attention backend (`bench serve`).
- `hf`: Hugging Face transformers on the same weights, static batching and
  continuous batching (`bench serve`).
- `routers`: two workers behind one router per policy, and one worker with
  both pools' memory (`bench route`).
- `vllm_kv`: vLLM's `KVCacheManager` given the same steps as the core
  (`bench core --against vllm`), run by an interpreter where vLLM is installed.
- `tiers`: a worker without KV tiers, with a host tier, two behind a router
  sharing a store, and one whose pool holds everything (`bench tiers`).

`Serving` is what every generating system of one comparison shares.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Serving:
    """The model, the KV pool and the limits that every system
    of one `bench serve` comparison uses."""

    model: str
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_tokens: int  # generated per request, EOS ignored
    batch_size: int  # rows per transformers static batch

    @property
    def slots(self) -> int:
        return self.num_blocks * self.block_size
