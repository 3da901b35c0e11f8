"""vLLM's `KVCacheManager` driven by a stream of allocator steps (`bench core --against vllm`).

Run as `python -m pagedkv.bench.systems.vllm_kv` by an interpreter where vLLM
is installed (it need not be this project's): the steps come as JSON on
stdin, `{"block_size", "num_blocks", "steps"}`, each step a list of
`["admit", seq, tokens]`, `["append", seq, [token]]` and `["free", seq]`;
the answer is JSON on stdout, `{"vllm": version, "step_cpu_s": [...]}`,
the CPU time of each step. Each step is what vLLM's scheduler asks of the
manager for the same work: a finished request freed; a running one given
its new token (its block hashes follow) and `allocate_slots(request, 1)`;
a new one looked up in the prefix cache (`get_computed_blocks`) and given
slots for the rest of its prompt. Prefix caching on, SHA-256 block hashes.
Imports only the standard library and vLLM.
"""

from __future__ import annotations

import json
import sys
import time


def drive(block_size: int, num_blocks: int, steps: list[list[list]]) -> dict:
    import torch
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    manager = KVCacheManager(
        config,
        max_model_len=1 << 16,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
    )
    hasher = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(max_tokens=1 << 16)
    running: dict[str, Request] = {}
    cpu: list[float] = []
    clock = time.process_time
    for step in steps:
        t0 = clock()
        for op in step:
            kind, seq = op[0], op[1]
            if kind == "append":
                r = running[seq]
                r.append_output_token_ids(op[2][0])
                if manager.allocate_slots(r, 1) is None:
                    raise RuntimeError("vLLM's pool is out of blocks: give it more")
                r.num_computed_tokens += 1
            elif kind == "admit":
                r = Request(seq, op[2], params, None, block_hasher=hasher)
                blocks, hit, _ = manager.get_computed_blocks(r)
                if manager.allocate_slots(r, len(op[2]) - hit, hit, blocks) is None:
                    raise RuntimeError("vLLM's pool is out of blocks: give it more")
                r.num_computed_tokens = len(op[2])
                running[seq] = r
            elif kind == "free":
                manager.free(running.pop(seq))
            else:
                raise ValueError(f"unknown operation {kind!r}")
        cpu.append(clock() - t0)
    return {"vllm": vllm.__version__, "step_cpu_s": cpu}


def main() -> None:
    job = json.load(sys.stdin)
    json.dump(drive(job["block_size"], job["num_blocks"], job["steps"]), sys.stdout)


if __name__ == "__main__":
    main()
