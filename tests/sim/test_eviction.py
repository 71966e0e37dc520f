import random

import pytest

from once.kv_eviction.base import LRU, BlockInfo
from once.kv_eviction.policies import (
    DEFAULT_EVICTION,
    EVICTION_POLICIES,
    Belady,
    FutureOracle,
    LeafLRU,
    LFUDynamicAging,
    ReuseDensity,
    age_bucket,
    eviction_factory,
)
from once.router.policies import make_policy
from once.sim.cli import main
from once.sim.cluster import Cluster
from once.sim.kvcache import BlockCache
from tests.sim.conftest import make_profile, make_request


def cache_one(cache: BlockCache, hashes: list[int], now: float = 0.0) -> None:
    """One request computes `hashes` (nothing matched), publishes and finishes."""
    num_matched = cache.match_prefix(hashes)
    held = cache.admit(hashes, num_matched, len(hashes), now)
    cache.publish(hashes, held, now)
    cache.release(held, len(hashes), now)


def hit(cache: BlockCache, hashes: list[int], now: float) -> None:
    num_matched = cache.match_prefix(hashes)
    assert num_matched == len(hashes)
    cache.release(cache.admit(hashes, num_matched, num_matched, now), num_matched, now)


def test_lru_stays_the_bare_cache_default_and_evicts_tail_first():
    cache = BlockCache(4)
    assert isinstance(cache.policy, LRU)
    cache_one(cache, [1, 2, 3])
    assert list(cache.lru) == [3, 2, 1]
    cache_one(cache, [7, 8])  # one block too many: the oldest, the tail 3, goes
    assert cache.match_prefix([1, 2, 3]) == 2 and cache.num_evictions == 1


def test_leaf_first_evicts_only_leaves_so_no_child_is_stranded():
    cache = BlockCache(4, LeafLRU(random.Random(0)))
    cache_one(cache, [1, 2], now=0.0)
    cache_one(cache, [1, 4], now=1.0)  # shares block 1, adds leaf 4
    cache_one(cache, [9, 10], now=3.0)  # one block too many: the oldest leaf, 2, goes
    assert cache.match_prefix([1, 2]) == 1 and cache.match_prefix([1, 4]) == 2
    cache_one(cache, [11, 12, 13], now=4.0)  # 3 more: 4, then 1 (now a leaf), then 10
    assert cache.cached == {9, 11, 12, 13} and cache.num_evictions == 4
    for block_hash in cache.cached:
        parent = cache.policy.blocks[block_hash].parent
        assert parent is None or parent in cache.cached  # nothing stranded


def test_leaf_first_counts_and_membership_follow_the_block_life():
    policy = LeafLRU(random.Random(0))
    cache = BlockCache(10, policy)
    held = cache.admit([1, 2], 0, 3)
    cache.publish([1, 2], held)
    assert len(policy) == 0 and 1 not in policy and policy.leaves == []
    cache.release(held, 3)
    assert len(policy) == 2 and 1 in policy and policy.leaves == [2]  # 1 has a child
    second = cache.admit([1, 2, 3], 2, 3)
    assert len(policy) == 0 and policy.blocks[1].num_hits == 1
    cache.publish([1, 2, 3], second)
    cache.release(second, 3)
    assert sorted(policy) == [1, 2, 3] and policy.leaves == [3]
    assert cache.num_used == 0 and cache.num_private == 0


def test_lfu_da_keeps_the_frequently_hit_prefix_and_ages_old_counts():
    cache = BlockCache(4, LFUDynamicAging(random.Random(0)))
    cache_one(cache, [1, 2], now=0.0)
    for now in (1.0, 2.0, 3.0):
        hit(cache, [1, 2], now)
    cache_one(cache, [5, 6], now=4.0)  # fills the cache
    cache_one(cache, [7], now=5.0)  # LRU would evict 2 (older); LFU evicts leaf 6
    assert cache.match_prefix([1, 2]) == 2 and cache.match_prefix([5, 6]) == 1
    assert cache.policy.inflation == 1.0  # the victim's priority: never hit
    # Blocks released later start from the inflated base, so old hits fade.
    cache_one(cache, [8], now=6.0)
    assert cache.policy.blocks[8].score == 2.0


def test_reuse_density_learns_which_class_comes_back():
    # Inner blocks are hit again 1 s after release; prompt tails never. After a refit a
    # fresh tail must go before a fresh inner block of the same age.
    policy = ReuseDensity(random.Random(0), sample_size=None)
    policy.recompute_every = 10**9  # refit by hand
    cache = BlockCache(500, policy)
    now = 0.0
    for turn in range(60):
        base = 1000 * turn
        cache_one(cache, [base, base + 1], now)  # block base + 1 is the prompt's tail
        hit(cache, [base], now + 1.0)
        now += 2.0
    policy.refit()
    inner = policy.block_class(BlockInfo(None, 0, False))
    tail = policy.block_class(BlockInfo(None, 1, True))
    assert max(policy.density[inner]) > 0 and max(policy.density[tail]) == 0
    policy.stored(-1, None, 0, False, now)  # an inner-class leaf, released first
    policy.released(-1, now)
    policy.stored(-2, None, 1, True, now)  # a tail, released later: LRU would keep it
    policy.released(-2, now + 0.2)
    assert policy.priority(-2, now + 0.3) < policy.priority(-1, now + 0.3)
    while -2 in policy:  # older zero-density blocks go first, then -2, never -1 before it
        policy.evict(now + 0.3)
        assert -1 in policy


def test_age_buckets_are_monotonic_and_bounded():
    ages = [0.0, 0.1, 0.25, 0.3, 1.0, 10.0, 100.0, 1e6]
    buckets = [age_bucket(age) for age in ages]
    assert buckets == sorted(buckets) and buckets[0] == 0 < buckets[3]
    assert age_bucket(1e9) == age_bucket(1e6)


def test_belady_evicts_the_block_used_farthest_in_the_future():
    requests = [
        make_request("a", 0.0, (1,)),
        make_request("b", 0.0, (2,)),
        make_request("c", 10.0, (2,)),  # 2 is needed at t=10, 1 never again
    ]
    oracle = FutureOracle()
    cache = BlockCache(2, Belady(oracle))
    cache.policy.prepare(requests)
    cache_one(cache, [1], now=0.0)
    cache_one(cache, [2], now=0.0)
    assert oracle.next_use_s(2) == 10.0 and oracle.next_use_s(1) == float("inf")
    cache_one(cache, [3], now=1.0)
    assert cache.match_prefix([2]) == 1 and cache.match_prefix([1]) == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        eviction_factory("fifo")
    with pytest.raises(SystemExit):
        main(["--eviction", "fifo"])


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_every_policy_keeps_the_cache_invariant_in_a_cluster(eviction):
    profile = make_profile(kv_blocks=12, max_num_seqs=4)
    rng = random.Random(7)
    requests = []
    for i in range(120):
        conversation = rng.randrange(6)
        depth = rng.randrange(1, 6)
        hashes = tuple(conversation * 100 + d for d in range(depth))
        requests.append(make_request(f"r{i}", i * 0.01, hashes, num_output=rng.randrange(1, 5)))
    cluster = Cluster([profile] * 2, make_policy("round_robin"), eviction=eviction)
    result = cluster.run(requests)
    assert all(s.finish_s is not None for s in result.states)
    for replica in result.replicas:
        cache = replica.cache
        assert cache.num_used == 0 and cache.num_private == 0
        assert len(cache.policy) == len(cache.cached) <= cache.capacity
    assert sum(s.num_cached_tokens for s in result.states) > 0


def test_the_simulator_defaults_to_an_online_policy():
    assert DEFAULT_EVICTION in EVICTION_POLICIES and DEFAULT_EVICTION != "belady"
