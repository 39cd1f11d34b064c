"""Chained hashes of full blocks of committed tokens, the keys of the prefix cache.

A block's hash covers its own tokens and, through ``parent_hash``, every token before it, so two
requests share a cached block only when their whole prefixes up to the end of that block agree:

    >>> h0 = hash_block_tokens(None, [1, 2, 3, 4])
    >>> h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    >>> h1 == hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    False

Only tokens whose keys and values are in the cache (committed: prompt and accepted output) are ever
hashed; speculative tokens never are.
"""

from __future__ import annotations

from collections.abc import Sequence

# Root of every chain. A fixed int (not None, whose hash varies between processes on Python 3.11).
_ROOT = 0x6C6F6F6B61686561


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (None for the first block)."""
    return hash((_ROOT if parent_hash is None else parent_hash, tuple(token_ids)))
