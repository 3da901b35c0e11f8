"""The KV-aware router: one OpenAI-style front door for many workers.

It learns the live workers from the allocator (`ListPools` and the pool
registered/dropped events), tokenizes each request once with the model's
tokenizer and chat template (the worker's own code), asks the allocator's
`MatchPrefix` how much of the prompt each worker's pool holds, and sends the
request where the cost (`policy.py`) is lowest, passing the answer through
unbuffered. It keeps no state the allocator does not have: a restart loses
nothing.
"""
