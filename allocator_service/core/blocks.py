"""How many blocks tokens take: the block contract's arithmetic.

Plain Python, never compiled (setup.py): the workers' CPU attention kernel
compiles this very function with numba, which takes Python functions only.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: a table's length (the block
    contract: token p lives in block p // block_size)."""
    return -(-num_tokens // block_size)
