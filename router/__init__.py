"""The KV-aware router: one OpenAI-style front door for many workers.

It learns the live workers from the allocator (`ListPools`, pool events),
tokenizes each request once with the worker's own tokenizer and chat
template, matches the prompt against each pool's prefix cache (its copy of
the allocator's index, or `MatchPrefix`) and sends the request where the
cost (`policy.py`) is lowest, passing the answer through unbuffered. Its
view of the pools is rebuilt from the allocator at start; a restart loses only
its own recent placements (`recent.py`).
"""
