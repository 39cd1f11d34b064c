"""KVCacheManager (exact block ids), prefix caching, and the numpy block table / slot mapping helpers.

Pure Python and numpy: no torch, no engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_serve.kv_cache import KVCacheManager, build_block_table, compute_slot_mapping, hash_block_tokens

BS = 4


def refcounts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -4])
def test_non_positive_block_size_rejected(block_size):
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, block_size)


def test_non_positive_num_blocks_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, BS)


# ---- allocate_slots ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps",
    [
        # (num_tokens asked for in total, newly allocated ids, all the request's ids)
        [(1, [0], [0]), (4, [], [0]), (5, [1], [0, 1]), (8, [], [0, 1]), (9, [2], [0, 1, 2])],
        [(3, [0], [0]), (12, [1, 2], [0, 1, 2]), (13, [3], [0, 1, 2, 3]), (32, [4, 5, 6, 7], list(range(8)))],
        [(0, [], []), (16, [0, 1, 2, 3], [0, 1, 2, 3]), (10, [], [0, 1, 2, 3])],  # shrinking asks take nothing
    ],
)
def test_allocate_slots_grows_block_by_block(steps):
    kv = KVCacheManager(8, BS)
    for num_tokens, new_ids, all_ids in steps:
        assert kv.allocate_slots("a", num_tokens) == new_ids
        assert kv.block_ids("a") == all_ids
        assert kv.num_free_blocks == 8 - len(all_ids)
        assert refcounts(kv)[: len(all_ids)] == [1] * len(all_ids)


def test_allocate_slots_interleaved_requests():
    kv = KVCacheManager(8, BS)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("b", 4) == [2]
    assert kv.allocate_slots("a", 9) == [3]
    assert kv.allocate_slots("c", 1) == [4]
    assert kv.allocate_slots("b", 6) == [5]
    assert kv.block_ids("a") == [0, 1, 3]
    assert kv.block_ids("b") == [2, 5]
    assert kv.block_ids("c") == [4]
    assert kv.block_ids("never-seen") == []
    assert kv.num_free_blocks == 2


def test_allocate_slots_short_pool_returns_none_and_changes_nothing():
    kv = KVCacheManager(4, BS)
    assert kv.allocate_slots("a", 12) == [0, 1, 2]
    before = refcounts(kv), list(kv.pool._free)

    # A new request that does not fit: refused, and it is not left owning an empty entry.
    assert kv.allocate_slots("b", 8) is None
    assert kv.block_ids("b") == []
    assert "b" not in kv._blocks
    # A growing request that does not fit: refused, keeps exactly what it had.
    assert kv.allocate_slots("a", 17) is None
    assert kv.block_ids("a") == [0, 1, 2]
    assert (refcounts(kv), list(kv.pool._free)) == before
    assert kv.num_free_blocks == 1

    # Exactly what is left still fits.
    assert kv.allocate_slots("a", 16) == [3]
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("b", 1) is None
    kv.free("a")
    assert kv.num_free_blocks == 4


def test_free_returns_blocks_tail_first_and_is_idempotent():
    kv = KVCacheManager(6, BS)
    kv.allocate_slots("a", 12)  # 0, 1, 2
    kv.allocate_slots("b", 4)  # 3
    kv.free("a")
    assert kv.block_ids("a") == []
    assert list(kv.pool._free) == [4, 5, 2, 1, 0]
    kv.free("a")  # safe to call twice
    kv.free("unknown")
    assert kv.num_free_blocks == 5
    kv.free("b")
    assert kv.num_free_blocks == 6
    assert refcounts(kv) == [0] * 6


# ---- prefix caching ----------------------------------------------------------------------------


def admit(kv: KVCacheManager, req_id: str, tokens: list[int]) -> tuple[list[int] | None, int]:
    """What the scheduler does for a waiting request: look up the cache, then allocate all its tokens."""
    hits, num_hit = kv.get_computed_blocks(tokens)
    assert num_hit == len(hits) * kv.block_size
    blocks = kv.allocate_slots(req_id, len(tokens), hits)
    if blocks is not None:
        kv.record_prefix_lookup(len(tokens), num_hit)
    return blocks, num_hit


def test_second_request_gets_the_first_requests_full_blocks():
    kv = KVCacheManager(10, BS)
    p = prompt(10)  # blocks: [0:4] [4:8] full, [8:10] partial
    assert admit(kv, "a", p) == ([0, 1, 2], 0)
    kv.cache_blocks("a", p, 10)
    assert kv.pool.num_cached_blocks == 2  # the partial block is never cached
    assert kv.pool.blocks[2].block_hash is None

    new_ids, num_hit = admit(kv, "b", p)
    assert num_hit == 8
    assert new_ids == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert refcounts(kv)[:4] == [2, 2, 1, 1]

    kv.free("a")
    assert refcounts(kv)[:4] == [1, 1, 0, 1]
    assert kv.num_free_blocks == 10 - 3
    kv.free("b")
    assert refcounts(kv) == [0] * 10
    assert kv.num_free_blocks == 10


@pytest.mark.parametrize(
    "num_tokens, expected_hit_blocks",
    [
        # The last token is never served from the cache, so a prompt of exactly k full blocks hits k - 1.
        (1, 0),
        (4, 0),
        (5, 1),
        (8, 1),
        (9, 2),
        (12, 2),
        (13, 3),
        (16, 3),
        (17, 4),
    ],
)
def test_last_token_never_served_from_cache(num_tokens, expected_hit_blocks):
    kv = KVCacheManager(16, BS)
    p = prompt(num_tokens)
    admit(kv, "a", p)
    kv.cache_blocks("a", p, num_tokens)
    assert kv.pool.num_cached_blocks == num_tokens // BS
    hits, num_hit = kv.get_computed_blocks(p)
    assert [b.block_id for b in hits] == list(range(expected_hit_blocks))
    assert num_hit == expected_hit_blocks * BS
    assert num_hit < num_tokens


@pytest.mark.parametrize(
    "num_committed, expected_cached",
    [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2), (12, 3), (14, 3)],
)
def test_only_full_committed_blocks_are_cached(num_committed, expected_cached):
    kv = KVCacheManager(8, BS)
    p = prompt(14)
    kv.allocate_slots("a", 14)
    kv.cache_blocks("a", p, num_committed)
    assert kv.pool.num_cached_blocks == expected_cached
    assert [b.block_hash is not None for b in kv.pool.blocks[:4]] == [i < expected_cached for i in range(4)]


def test_cache_blocks_never_goes_past_owned_blocks():
    kv = KVCacheManager(8, BS)
    p = prompt(16)
    kv.allocate_slots("a", 8)  # owns two blocks only
    kv.cache_blocks("a", p, 16)
    assert kv.pool.num_cached_blocks == 2


def test_cache_blocks_incrementally_uses_chained_hashes():
    kv = KVCacheManager(8, BS)
    p = prompt(12)
    kv.allocate_slots("a", 12)
    kv.cache_blocks("a", p, 4)
    kv.cache_blocks("a", p, 9)
    kv.cache_blocks("a", p, 12)
    h0 = hash_block_tokens(None, p[0:4])
    h1 = hash_block_tokens(h0, p[4:8])
    h2 = hash_block_tokens(h1, p[8:12])
    assert [kv.pool.blocks[i].block_hash for i in range(3)] == [h0, h1, h2]
    assert kv.pool.lookup(h2) is kv.pool.blocks[2]


@pytest.mark.parametrize(
    "second_prompt, expected_hit_ids",
    [
        (prompt(12), [0, 1]),  # same 12 tokens: the last block is withheld (last token)
        (prompt(12) + [7], [0, 1, 2]),  # one more token: all three full blocks
        (prompt(8) + [1, 2, 3, 4, 5], [0, 1]),  # diverges in the third block
        (prompt(4) + [9] + prompt(8)[5:] + prompt(5, 108), [0]),  # diverges in the second block
        ([0] + prompt(12)[1:] + [5], []),  # first token differs: no hit, although later blocks agree
        (prompt(3) + [0], []),  # shorter than a block
    ],
)
def test_hits_need_the_whole_prefix_to_agree(second_prompt, expected_hit_ids):
    kv = KVCacheManager(16, BS)
    p = prompt(12)
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 12)
    new_ids, num_hit = admit(kv, "b", second_prompt)
    assert num_hit == len(expected_hit_ids) * BS
    assert kv.block_ids("b")[: len(expected_hit_ids)] == expected_hit_ids
    assert new_ids == list(range(3, 3 + len(kv.block_ids("b")) - len(expected_hit_ids)))
    for i in expected_hit_ids:
        assert kv.pool.blocks[i].ref_cnt == 2


def test_same_block_contents_at_different_positions_do_not_hit():
    kv = KVCacheManager(8, BS)
    p = [1, 2, 3, 4] * 3
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 12)
    # Three identical blocks, but each has its own chained hash.
    assert kv.pool.num_cached_blocks == 3
    hits, _ = kv.get_computed_blocks([1, 2, 3, 4, 9])
    assert [b.block_id for b in hits] == [0]


@pytest.mark.parametrize(
    "a, b, equal",
    [
        ((None, [1, 2, 3, 4]), (None, [1, 2, 3, 4]), True),
        ((None, [1, 2, 3, 4]), (None, [4, 3, 2, 1]), False),  # order matters
        ((None, [1, 2, 3, 4]), (None, [1, 2, 3, 5]), False),
        ((None, [1, 2, 3, 4]), (None, (1, 2, 3, 4)), True),  # any sequence type
        ((None, [1, 2, 3, 4]), (123, [1, 2, 3, 4]), False),  # the parent matters
        ((5, [1, 2]), (6, [1, 2]), False),
    ],
)
def test_hash_block_tokens(a, b, equal):
    assert (hash_block_tokens(*a) == hash_block_tokens(*b)) is equal
    assert hash_block_tokens(*a) == hash_block_tokens(*a)


def test_permuted_block_does_not_hit():
    kv = KVCacheManager(8, BS)
    p = [1, 2, 3, 4, 5]
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 5)
    hits, num_hit = kv.get_computed_blocks([4, 3, 2, 1, 5])
    assert hits == [] and num_hit == 0


def test_hit_run_stops_at_the_first_missing_block():
    """Only a contiguous run of cached blocks from the start counts, even if later blocks are cached."""
    kv = KVCacheManager(8, BS)
    p = prompt(13)
    kv.allocate_slots("a", 13)
    h0 = hash_block_tokens(None, p[0:4])
    h1 = hash_block_tokens(h0, p[4:8])
    h2 = hash_block_tokens(h1, p[8:12])
    blocks = kv._blocks["a"]
    kv.pool.cache(blocks[0], h0)
    kv.pool.cache(blocks[2], h2)  # block 1 is not cached
    hits, num_hit = kv.get_computed_blocks(p)
    assert [b.block_id for b in hits] == [0]
    assert num_hit == 4


def test_hits_on_free_but_still_cached_blocks():
    kv = KVCacheManager(4, BS)
    p = prompt(9)
    assert admit(kv, "a", p) == ([0, 1, 2], 0)
    kv.cache_blocks("a", p, 9)
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.pool.num_cached_blocks == 2  # freed, still cached
    assert list(kv.pool._free) == [3, 2, 1, 0]

    new_ids, num_hit = admit(kv, "b", p)
    assert num_hit == 8
    assert new_ids == [3]  # blocks 0 and 1 were revived, so the new block is the head of what is left
    assert kv.block_ids("b") == [0, 1, 3]
    assert refcounts(kv) == [1, 1, 0, 1]
    assert kv.num_free_blocks == 1
    kv.free("b")
    assert kv.num_free_blocks == 4


def test_revived_blocks_count_against_free_blocks():
    kv = KVCacheManager(4, BS)
    p = prompt(9)
    admit(kv, "a", p)  # 0, 1, 2
    kv.cache_blocks("a", p, 9)  # 0, 1 cached
    kv.free("a")  # queue: 3, 2, 1, 0
    assert kv.allocate_slots("c", 8) == [3, 2]  # uncached blocks go first; 1 and 0 remain, cached
    assert kv.pool.num_cached_blocks == 2

    hits, num_hit = kv.get_computed_blocks(p)
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    # Needs 1 new block plus the 2 revived ones, but only 2 blocks are free: refused, nothing changes.
    assert kv.allocate_slots("b", 9, hits) is None
    assert kv.block_ids("b") == []
    assert refcounts(kv) == [0, 0, 1, 1]
    assert list(kv.pool._free) == [1, 0]
    assert kv.pool.lookup(hits[0].block_hash) is hits[0]
    assert kv.num_free_blocks == 2

    # Without the extra block it fits: both revived, none allocated.
    assert kv.allocate_slots("b", 8, hits) == []
    assert kv.block_ids("b") == [0, 1]
    assert kv.num_free_blocks == 0
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 4


def test_shared_blocks_in_use_do_not_count_against_free_blocks():
    kv = KVCacheManager(4, BS)
    p = prompt(9)
    admit(kv, "a", p)  # 0, 1, 2, still running
    kv.cache_blocks("a", p, 9)
    new_ids, num_hit = admit(kv, "b", p)  # needs 1 new block; 1 is free
    assert (new_ids, num_hit) == ([3], 8)
    assert refcounts(kv) == [2, 2, 1, 1]
    assert kv.num_free_blocks == 0
    kv.free("a")
    kv.free("b")
    assert refcounts(kv) == [0, 0, 0, 0]
    assert kv.num_free_blocks == 4


def test_cached_tail_blocks_are_evicted_first():
    kv = KVCacheManager(4, BS)
    p = prompt(13)
    admit(kv, "a", p)  # 0, 1, 2, 3
    kv.cache_blocks("a", p, 12)  # 0, 1, 2 cached
    kv.free("a")  # tail first: queue 3, 2, 1, 0
    assert kv.allocate_slots("d", 5) == [3, 2]  # takes the uncached block and a's last cached block
    assert kv.pool.num_cached_blocks == 2
    hits, num_hit = kv.get_computed_blocks(p)
    assert [b.block_id for b in hits] == [0, 1]  # the prefix survives
    assert num_hit == 8


def test_computed_blocks_only_for_a_request_owning_none():
    kv = KVCacheManager(8, BS)
    p = prompt(9)
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 9)
    kv.allocate_slots("b", 2)
    hits, _ = kv.get_computed_blocks(p)
    with pytest.raises(ValueError, match="computed_blocks"):
        kv.allocate_slots("b", 9, hits)


def test_revived_request_extends_the_cache_from_its_hits():
    """A request admitted with hits continues the hash chain: a third request then hits its new block."""
    kv = KVCacheManager(16, BS)
    p = prompt(9)
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 9)  # 0, 1

    longer = p[:8] + [7, 7, 7, 7, 7]  # shares two blocks, adds a third full block
    assert admit(kv, "b", longer) == ([3, 4], 8)
    assert kv.block_ids("b") == [0, 1, 3, 4]
    kv.cache_blocks("b", longer, 13)
    assert kv.pool.blocks[3].block_hash == hash_block_tokens(
        hash_block_tokens(hash_block_tokens(None, p[0:4]), p[4:8]), [7, 7, 7, 7]
    )
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.num_cached_blocks == 3

    new_ids, num_hit = admit(kv, "c", longer + [1])
    assert num_hit == 12
    assert kv.block_ids("c") == [0, 1, 3, 5]
    assert new_ids == [5]
    assert refcounts(kv)[:6] == [3, 3, 1, 2, 1, 1]
    for r in ("a", "b", "c"):
        kv.free(r)
    assert kv.num_free_blocks == 16


def test_generated_tokens_become_cacheable_as_they_commit():
    """Decode one token at a time, caching committed blocks: a new prompt equal to prompt+output hits them."""
    kv = KVCacheManager(8, BS)
    tokens = prompt(6)
    admit(kv, "a", tokens)
    kv.cache_blocks("a", tokens, 6)
    for t in [50, 51, 52, 53, 54]:
        tokens.append(t)  # sampled; its KV is written next step
        assert kv.allocate_slots("a", len(tokens)) is not None
        kv.cache_blocks("a", tokens, len(tokens) - 1)
    # 11 tokens; 10 committed -> two full blocks cached.
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 2
    new_ids, num_hit = admit(kv, "b", tokens[:8] + [99])
    assert num_hit == 8
    assert kv.block_ids("b") == [0, 1, 3]


def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    p = prompt(9)
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 9)
    assert kv.pool.num_cached_blocks == 0
    assert admit(kv, "b", p) == ([3, 4, 5], 0)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_prefix_hit_statistics():
    kv = KVCacheManager(8, BS)
    p = prompt(9)
    admit(kv, "a", p)
    kv.cache_blocks("a", p, 9)
    admit(kv, "b", p)
    assert kv.num_prefix_query_tokens == 18
    assert kv.num_prefix_hit_tokens == 8


@pytest.mark.parametrize("num_blocks, block_size", [(4, 1), (6, 2), (8, 4), (5, 8)])
def test_no_block_leaks_after_many_requests(num_blocks, block_size):
    kv = KVCacheManager(num_blocks, block_size)
    shared = prompt(block_size * 2)
    live: list[str] = []
    for i in range(30):
        tokens = shared + [i] * (i % (block_size + 2))
        rid = f"r{i}"
        new_ids, _ = admit(kv, rid, tokens)
        if new_ids is None:
            # Refused: free the oldest and retry until it fits (or the pool is empty of owners).
            while new_ids is None and live:
                kv.free(live.pop(0))
                new_ids, _ = admit(kv, rid, tokens)
        if new_ids is None:
            continue
        kv.cache_blocks(rid, tokens, len(tokens))
        live.append(rid)
        owners = [b.block_id for r in live for b in kv._blocks[r]]
        assert [b.ref_cnt for b in kv.pool.blocks] == [owners.count(j) for j in range(num_blocks)]
    for rid in live:
        kv.free(rid)
    assert kv.num_free_blocks == num_blocks
    assert refcounts(kv) == [0] * num_blocks


# ---- block table and slot mapping --------------------------------------------------------------


@pytest.mark.parametrize(
    "block_ids, pad, expected, shape",
    [
        ([[7, 2], [5]], 0, [[7, 2], [5, 0]], (2, 2)),
        ([[7, 2], [5]], -1, [[7, 2], [5, -1]], (2, 2)),
        ([[1, 2, 3]], 0, [[1, 2, 3]], (1, 3)),
        ([[], [4]], 9, [[9], [4]], (2, 1)),
        ([[]], 0, [[0]], (1, 1)),
        ([], 0, [], (0, 1)),
        ([[3], [1, 2, 0, 6], []], 0, [[3, 0, 0, 0], [1, 2, 0, 6], [0, 0, 0, 0]], (3, 4)),
    ],
)
def test_build_block_table(block_ids, pad, expected, shape):
    table = build_block_table(block_ids, pad=pad)
    assert table.dtype == np.int64
    assert table.shape == shape
    assert table.tolist() == expected


@pytest.mark.parametrize(
    "table, req_indices, positions, block_size, expected",
    [
        ([[7, 2], [5]], [0, 0, 1], [3, 4, 1], 4, [31, 8, 21]),
        ([[7, 2], [5]], [0, 0, 0, 0], [0, 1, 2, 3], 4, [28, 29, 30, 31]),
        ([[3, 1, 4]], [0, 0, 0], [0, 1, 2], 1, [3, 1, 4]),
        ([[0, 9], [2, 6]], [1, 0, 1, 0], [15, 15, 0, 8], 8, [55, 79, 16, 72]),
        ([[5]], [], [], 16, []),
    ],
)
def test_compute_slot_mapping(table, req_indices, positions, block_size, expected):
    t = build_block_table(table)
    slots = compute_slot_mapping(
        t, np.array(req_indices, dtype=np.int64), np.array(positions, dtype=np.int64), block_size
    )
    assert slots.tolist() == expected


def test_slot_mapping_matches_reference_and_slots_are_unique():
    """Slots from the manager's block ids: each equals table[pos // bs] * bs + pos % bs, and no two collide."""
    kv = KVCacheManager(32, BS)
    lens = {"a": 13, "b": 4, "c": 30, "d": 1}
    for rid, n in lens.items():
        assert kv.allocate_slots(rid, n) is not None
    rids = list(lens)
    table = build_block_table([kv.block_ids(r) for r in rids])
    req_idx = np.concatenate([np.full(lens[r], i) for i, r in enumerate(rids)])
    pos = np.concatenate([np.arange(lens[r]) for r in rids])
    slots = compute_slot_mapping(table, req_idx, pos, BS)
    expected = [kv.block_ids(rids[i])[p // BS] * BS + p % BS for i, p in zip(req_idx.tolist(), pos.tolist())]
    assert slots.tolist() == expected
    assert len(set(slots.tolist())) == sum(lens.values())
    assert all(0 <= s < 32 * BS for s in slots.tolist())
