"""PagedKV: a paged KV-cache memory manager for LLM serving.

This package holds the `pagedkv` command line, the offline tools (replay,
kv-size, simulate, bench) and the generated gRPC contract (`pagedkv.v1`).
The allocator's block logic lives in `allocator_service.core`, the model
runtime in `worker`.
"""

__version__ = "0.1.0"
