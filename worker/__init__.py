"""PagedKV worker: a model, its KV pool and an OpenAI-style API over the allocator.

Layers, each importing only those below it (checked by `lint-imports`):
`cli` -> `server` (HTTP) -> `engine` (scheduler, model runner, output
processor) -> `model` (decoder, tokenizer, loaders) | `metrics` ->
`attention` | `kv_pool` (the physical K/V blocks) -> `kv_bytes` (dtype table
and KV-bytes formula, torch-free). Kept import-light on purpose: importing
`worker` pulls no torch.
"""
