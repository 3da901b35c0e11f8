"""What crosses between the allocator and its clients: the protobuf messages
(`v1/`, generated from proto/pagedkv/v1/), their conversion to and from the
core's values (`codec.py`), how large an answer can be (`bounds.py`), every
refusal with the reason it carries (`errors.py`) and the proof a worker
gives of the pool it serves (`attest.py`). Imports no server-side module.
"""
