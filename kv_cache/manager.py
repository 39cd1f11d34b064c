"""Per-request KV blocks: allocate (or say no), free, prefix-cache lookups and registration.

The manager never raises for lack of space: ``allocate_slots`` returns None and the scheduler decides
what to do (preempt a request and retry, or wait).
"""

from __future__ import annotations

from collections.abc import Sequence

from lookahead_serve.kv_cache.block_pool import BlockPool, KVBlock
from lookahead_serve.kv_cache.hashing import hash_block_tokens


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a tokens."""
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of the request's full committed blocks
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(req_id, ())]

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks that prefixes ``token_ids``, and how many tokens it covers.

        The last token is never served from the cache: the model must compute at least one token to
        produce the next token's logits.
        """
        hits: list[KVBlock] = []
        parent = None
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(parent)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted request's lookup (once per admission, not per try while it waits)."""
        self.num_prefix_query_tokens += num_tokens
        self.num_prefix_hit_tokens += num_hit

    def allocate_slots(
        self, req_id: str, num_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Make the request own enough blocks for ``num_tokens`` tokens in total.

        ``computed_blocks`` (from ``get_computed_blocks``, only when the request owns no blocks yet) are
        taken first. Returns the ids of the newly allocated blocks, or None, changing nothing, when the
        pool is short.
        """
        owned = self._blocks.setdefault(req_id, [])
        if computed_blocks and owned:
            raise ValueError("computed_blocks are only taken by a request that owns no blocks")
        num_needed = cdiv(num_tokens, self.block_size) - len(owned) - len(computed_blocks)
        # Cached blocks nobody references sit in the free queue: touching them uses up free blocks too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + num_revived > self.pool.num_free_blocks:
            if not owned:
                del self._blocks[req_id]
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            owned.extend(computed_blocks)
            self._hashes[req_id] = [b.block_hash for b in computed_blocks]  # type: ignore[misc]
        new_blocks = self.pool.allocate(num_needed) if num_needed > 0 else []
        assert new_blocks is not None  # checked above
        owned.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_committed: int) -> None:
        """Register every full block within the first ``num_committed`` tokens in the prefix cache."""
        if not self.pool.enable_caching:
            return
        hashes = self._hashes.setdefault(req_id, [])
        blocks = self._blocks[req_id]
        num_full = min(num_committed // self.block_size, len(blocks))
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            h = hash_block_tokens(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            self.pool.cache(blocks[i], h)

    def free(self, req_id: str) -> None:
        """Release every block of the request (tail first); safe to call twice."""
        blocks = self._blocks.pop(req_id, [])
        self._hashes.pop(req_id, None)
        self.pool.free(reversed(blocks))
