"""The eviction policies on their own, without a cache around them: the life of a block
(stored -> released -> acquired -> ... -> evicted) as the engine's pool, its host tier and
the simulator's caches drive it."""

import random

import pytest

from once.kv_eviction.base import LRU
from once.kv_eviction.policies import EVICTION_POLICIES, LeafLRU, eviction_factory


def test_lru_evicts_the_least_recently_released_and_a_demoted_block_first():
    policy = LRU()
    for block_hash in (1, 2, 3):
        policy.stored(block_hash, None, 0, False, 0.0)
        policy.released(block_hash, 0.0)
    policy.acquired(1, 1.0)
    policy.released(1, 2.0)  # 1 is now the most recently released
    policy.demote(3, 2.0)
    assert [policy.evict(3.0) for _ in range(3)] == [3, 2, 1]
    assert len(policy) == 0


def test_a_prefix_aware_policy_evicts_a_child_before_its_parent():
    policy = LeafLRU(random.Random(0))
    policy.stored(10, None, 0, False, 0.0)
    policy.stored(11, 10, 1, True, 0.0)
    policy.released(11, 1.0)  # a request frees its blocks tail first
    policy.released(10, 2.0)
    assert 10 in policy and 11 in policy
    assert policy.evict(3.0) == 11  # the parent is no leaf while its child is cached
    assert policy.evict(3.0) == 10


def test_the_factory_makes_one_policy_per_call_and_refuses_unknown_names():
    for name in EVICTION_POLICIES:
        make = eviction_factory(name, seed=1)
        assert make() is not make()
    with pytest.raises(ValueError, match="unknown eviction policy"):
        eviction_factory("fifo")
