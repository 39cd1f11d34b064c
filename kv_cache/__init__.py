"""Paged KV-cache bookkeeping: block pool, prefix-cache hashing, per-request manager.

Pure Python and numpy: nothing here imports torch, so it is tested in milliseconds.
"""

from lookahead_serve.kv_cache.block_pool import BlockPool, KVBlock
from lookahead_serve.kv_cache.block_table import build_block_table, compute_slot_mapping
from lookahead_serve.kv_cache.hashing import hash_block_tokens
from lookahead_serve.kv_cache.manager import KVCacheManager, cdiv

__all__ = [
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "build_block_table",
    "cdiv",
    "compute_slot_mapping",
    "hash_block_tokens",
]
