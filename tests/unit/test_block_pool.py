"""BlockPool: allocation, reference counts, the LRU free queue and the prefix-cache index.

Pure Python: no torch, no engine.
"""

from __future__ import annotations

import pytest

from lookahead_serve.kv_cache import BlockPool, KVBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    """Ids in the free queue, head (next to be reused) first."""
    return list(pool._free)


# ---- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [0, -1, -10])
def test_non_positive_num_blocks_rejected(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


@pytest.mark.parametrize("num_blocks", [1, 3, 16])
def test_fresh_pool_is_all_free_and_uncached(num_blocks):
    pool = BlockPool(num_blocks)
    assert pool.num_free_blocks == num_blocks
    assert pool.num_cached_blocks == 0
    assert pool.usage() == 0.0
    assert ids(pool.blocks) == list(range(num_blocks))
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    assert free_order(pool) == list(range(num_blocks))


# ---- allocate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_blocks, requests, expected",
    [
        # (pool size, successive allocate() sizes, expected ids per call; None = refused)
        (4, [1, 1, 1, 1], [[0], [1], [2], [3]]),
        (4, [2, 2], [[0, 1], [2, 3]]),
        (4, [4], [[0, 1, 2, 3]]),
        (4, [5], [None]),
        (4, [3, 2, 1], [[0, 1, 2], None, [3]]),
        (4, [0, 2], [[], [0, 1]]),
        (1, [1, 1], [[0], None]),
    ],
)
def test_allocate_takes_from_the_head_in_order(num_blocks, requests, expected):
    pool = BlockPool(num_blocks)
    taken = 0
    for n, want in zip(requests, expected, strict=True):
        got = pool.allocate(n)
        if want is None:
            assert got is None
        else:
            assert ids(got) == want
            assert all(b.ref_cnt == 1 for b in got)
            taken += n
        assert pool.num_free_blocks == num_blocks - taken
        assert pool.usage() == pytest.approx(taken / num_blocks)


def test_allocate_refused_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    before_free = free_order(pool)
    before = [(b.ref_cnt, b.block_hash) for b in pool.blocks]
    assert pool.allocate(3) is None
    assert free_order(pool) == before_free
    assert [(b.ref_cnt, b.block_hash) for b in pool.blocks] == before
    # What was free is still there to take.
    assert ids(pool.allocate(2)) == [2, 3]


def test_allocate_refused_keeps_cached_hashes():
    pool = BlockPool(2)
    [b0, b1] = pool.allocate(2)
    pool.cache(b0, 100)
    pool.free([b0])
    assert pool.allocate(2) is None  # only one block free
    assert pool.lookup(100) is b0
    assert b0.block_hash == 100


# ---- free and ref counts -----------------------------------------------------------------------


def test_free_drops_one_reference_and_frees_at_zero():
    pool = BlockPool(3)
    [b0] = pool.allocate(1)
    pool.touch([b0])  # a second owner
    assert b0.ref_cnt == 2
    pool.free([b0])
    assert b0.ref_cnt == 1
    assert 0 not in pool._free
    assert pool.num_free_blocks == 2
    pool.free([b0])
    assert b0.ref_cnt == 0
    assert pool.num_free_blocks == 3


def test_double_free_raises():
    pool = BlockPool(2)
    [b0] = pool.allocate(1)
    pool.free([b0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([b0])
    assert b0.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([pool.blocks[1]])


@pytest.mark.parametrize(
    "alloc, free_in_order, expected_queue",
    [
        # Freed blocks go to the tail of the free queue, in the order they are passed.
        (3, [0, 1, 2], [3, 4, 5, 0, 1, 2]),
        (3, [2, 1, 0], [3, 4, 5, 2, 1, 0]),
        (3, [1], [3, 4, 5, 1]),
        (6, [5, 0, 3], [5, 0, 3]),
    ],
)
def test_freed_blocks_return_to_the_tail(alloc, free_in_order, expected_queue):
    pool = BlockPool(6)
    blocks = pool.allocate(alloc)
    pool.free([blocks[i] for i in free_in_order])
    assert free_order(pool) == expected_queue
    # Allocation follows the queue: head first.
    assert ids(pool.allocate(len(expected_queue))) == expected_queue


def test_lru_order_across_frees():
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    b = pool.allocate(2)  # 2, 3
    pool.free(b)  # freed first -> reused first
    pool.free(a)
    assert ids(pool.allocate(1)) == [2]
    assert ids(pool.allocate(3)) == [3, 0, 1]


# ---- touch -------------------------------------------------------------------------------------


def test_touch_revives_a_free_block_off_the_queue():
    pool = BlockPool(3)
    [b0, b1, b2] = pool.allocate(3)
    pool.free([b1, b0, b2])
    assert free_order(pool) == [1, 0, 2]
    pool.touch([b0])
    assert b0.ref_cnt == 1
    assert free_order(pool) == [1, 2]
    assert pool.num_free_blocks == 2
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.allocate(1) is None


def test_touch_of_used_block_only_adds_a_reference():
    pool = BlockPool(2)
    [b0] = pool.allocate(1)
    pool.touch([b0, b0])
    assert b0.ref_cnt == 3
    assert pool.num_free_blocks == 1


# ---- cache / lookup ----------------------------------------------------------------------------


def test_cache_then_lookup():
    pool = BlockPool(4)
    [b0, b1] = pool.allocate(2)
    assert pool.lookup(11) is None
    pool.cache(b0, 11)
    pool.cache(b1, 22)
    assert pool.lookup(11) is b0
    assert pool.lookup(22) is b1
    assert pool.lookup(33) is None
    assert b0.block_hash == 11 and b1.block_hash == 22
    assert pool.num_cached_blocks == 2


def test_cache_keeps_the_first_hash_of_a_block():
    pool = BlockPool(2)
    [b0] = pool.allocate(1)
    pool.cache(b0, 11)
    pool.cache(b0, 22)  # ignored: the block already has a hash
    assert b0.block_hash == 11
    assert pool.lookup(11) is b0
    assert pool.lookup(22) is None
    assert pool.num_cached_blocks == 1


def test_cache_keeps_the_first_block_with_a_hash():
    pool = BlockPool(2)
    [b0, b1] = pool.allocate(2)
    pool.cache(b0, 11)
    pool.cache(b1, 11)  # same content computed twice: the first block keeps the entry
    assert pool.lookup(11) is b0
    assert b1.block_hash is None
    assert pool.num_cached_blocks == 1


def test_freed_block_stays_cached_until_reallocated():
    pool = BlockPool(2)
    [b0, b1] = pool.allocate(2)
    pool.cache(b0, 11)
    pool.cache(b1, 22)
    pool.free([b1, b0])  # queue: 1, 0
    assert pool.lookup(11) is b0 and pool.lookup(22) is b1
    assert pool.num_cached_blocks == 2
    # Reallocating takes block 1 first and evicts its hash only.
    assert ids(pool.allocate(1)) == [1]
    assert pool.lookup(22) is None
    assert b1.block_hash is None
    assert pool.lookup(11) is b0
    assert pool.num_cached_blocks == 1
    assert ids(pool.allocate(1)) == [0]
    assert pool.lookup(11) is None
    assert pool.num_cached_blocks == 0


def test_evicted_hash_can_be_registered_again():
    pool = BlockPool(1)
    [b0] = pool.allocate(1)
    pool.cache(b0, 11)
    pool.free([b0])
    [again] = pool.allocate(1)
    assert again is b0 and b0.block_hash is None
    pool.cache(b0, 22)
    assert pool.lookup(22) is b0
    assert pool.lookup(11) is None


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    [b0] = pool.allocate(1)
    pool.cache(b0, 11)
    assert b0.block_hash is None
    assert pool.lookup(11) is None
    assert pool.num_cached_blocks == 0


def test_kvblock_defaults():
    b = KVBlock(7)
    assert (b.block_id, b.ref_cnt, b.block_hash) == (7, 0, None)
