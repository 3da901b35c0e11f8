"""PagedKV worker: the model layer a worker process runs.

`worker.kv_pool` holds the physical K/V blocks, `worker.attention` reads and
writes them through block tables, `worker.model` is a Llama-family decoder and
its loaders. The engine (scheduler, HTTP) builds on these; nothing here talks
to the allocator. Kept import-light on purpose: importing `worker` pulls no torch.
"""
