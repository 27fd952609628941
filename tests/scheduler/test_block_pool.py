import pytest

from llmserve.scheduler.block_pool import BlockPool


def test_hands_out_lowest_ids_first_and_reuses_oldest_freed():
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 2
    pool.free([1])
    pool.free([0])
    assert pool.free_block_ids() == [3, 4, 1, 0]
    assert pool.allocate(3) == [3, 4, 1]
    assert pool.allocate(1) == [0]
    assert pool.num_free_blocks == 0
    assert pool.allocate(0) == []


def test_free_releases_in_given_order():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0, 3])
    assert pool.free_block_ids() == [2, 0, 3]
    assert pool.allocate(2) == [2, 0]


def test_over_allocation_raises_and_allocates_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [2]


def test_ref_counts():
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    assert pool.ref_count(0) == 1
    pool.incref([0])
    assert pool.ref_count(0) == 2
    pool.free([0])
    assert pool.ref_count(0) == 1
    assert pool.free_block_ids() == [1, 2]  # Still held once.
    pool.free([0])
    assert pool.ref_count(0) == 0
    assert pool.free_block_ids() == [1, 2, 0]


def test_double_free_raises():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([0])


def test_double_free_in_one_call_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="double free of block 1"):
        pool.free([0, 1, 1])
    assert pool.ref_count(0) == 1
    assert pool.ref_count(1) == 1
    assert pool.free_block_ids() == [2]


def test_incref_of_free_block_and_bad_ids():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="incref of free block 1"):
        pool.incref([1])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([2])
    with pytest.raises(ValueError):
        BlockPool(0)
