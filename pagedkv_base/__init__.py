"""What every PagedKV component shares, at the bottom of the layers: it imports
none of `pagedkv`, `router`, `worker` or `allocator_service`, and no torch.

- `settings`: the one configuration scheme (flags, `PAGEDKV_<COMPONENT>_<FLAG>`
  variables, the one user-facing error);
- `api`: the OpenAI-style request models, the one error shape with its body
  limit and API-key check, bodies parsed off the event loop, client hang-ups
  (the worker and the router serve the same API);
- `tokenizer` and `model_files`: where a model's files are and its tokenizer
  and chat template, so the router tokenizes as the worker does without an engine.

Importing this package imports nothing; each module pulls only its own
libraries (the allocator reads `settings` without FastAPI or tokenizers).
"""
