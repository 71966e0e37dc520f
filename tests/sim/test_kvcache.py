import pytest

from once.sim.kvcache import BlockCache


def test_published_blocks_are_matched_and_survive_release():
    cache = BlockCache(8)
    held = cache.admit([1, 2, 3], 0, 4)  # 3 prompt blocks + 1 output block, nothing cached
    assert held == [] and cache.num_used == 4 and cache.match_prefix([1, 2, 3]) == 0
    cache.publish([1, 2, 3], held)
    assert held == [1, 2, 3] and cache.match_prefix([1, 2, 9]) == 2
    cache.release(held, 4)
    assert cache.num_used == 0 and list(cache.lru) == [3, 2, 1]  # tail first in LRU order
    assert cache.match_prefix([1, 2, 3, 4]) == 3


def test_eviction_takes_the_tail_of_the_least_recent_prompt_first():
    cache = BlockCache(4)
    held = cache.admit([1, 2, 3], 0, 3)
    cache.publish([1, 2, 3], held)
    cache.release(held, 3)
    other = cache.admit([7, 8], 0, 2)  # needs 1 block more than the free space
    assert cache.num_evictions == 1 and cache.match_prefix([1, 2, 3]) == 2
    assert cache.num_used + len(cache.lru) <= cache.capacity
    cache.release(other, 2)


def test_referenced_blocks_are_never_evicted_and_admission_waits():
    cache = BlockCache(4)
    held = cache.admit([1, 2], 0, 3)
    cache.publish([1, 2], held)
    assert not cache.can_admit([5, 6], 0, 2)  # 3 used, 1 free
    matched = cache.match_prefix([1, 2, 5])
    assert matched == 2 and cache.can_admit([1, 2, 5], matched, 3)  # shares 2 blocks
    second = cache.admit([1, 2, 5], matched, 3)
    assert cache.refs == {1: 2, 2: 2} and cache.num_used == 4
    with pytest.raises(ValueError):
        cache.admit([9], 0, 1)
    cache.release(second, 3)
    cache.release(held, 3)
    assert cache.num_used == 0 and cache.num_private == 0


def test_a_block_published_twice_stays_a_private_duplicate():
    cache = BlockCache(10)
    first = cache.admit([1, 2], 0, 2)
    second = cache.admit([1, 2], 0, 2)  # both missed: computed concurrently
    cache.publish([1, 2], first)
    cache.publish([1, 2], second)
    assert first == [1, 2] and second == [] and cache.num_used == 4
    cache.release(second, 2)
    cache.release(first, 2)
    assert cache.num_used == 0 and len(cache.lru) == 2


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        BlockCache(0)
