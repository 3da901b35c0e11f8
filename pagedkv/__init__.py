"""PagedKV: a paged KV-cache memory manager for LLM serving.

This package is the umbrella on top of the two services: the `pagedkv`
command line, the local stack launcher, the offline tools (replay, kv-size,
simulate) and the benchmarks.
The allocator's block logic lives in `allocator_service.core`, the model
runtime in `worker`.
"""

__version__ = "0.1.0"
