"""Block pool, prefix hashing and KV manager: exact block ids, eviction order, events."""

import pytest

from once.engine.kv.blocks import BlockPool
from once.engine.kv.manager import KVCacheManager
from once.engine.request import Request
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.kv_blocks import (
    NONE_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    hash_block_tokens,
)


def make_request(rid, tokens, salt=None, max_tokens=4):
    req = GenerateRequest(
        rid, tuple(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt
    )
    return Request(req, eos_token_ids=(), max_len=1024)


def test_hashes_chain_over_whole_prefix():
    a = block_hashes(list(range(12)), 4)
    b = block_hashes([99] + list(range(1, 12)), 4)
    assert len(a) == 3  # only full blocks are hashed
    assert a[0] == hash_block_tokens(NONE_HASH, [0, 1, 2, 3])
    assert a[1] == hash_block_tokens(a[0], [4, 5, 6, 7])
    # Blocks 1 and 2 hold equal tokens in both, but a different first block changes them.
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert block_hashes(list(range(10)), 4) == a[:2]


def test_cache_salt_separates_tenants():
    tokens = list(range(8))
    assert block_hashes(tokens, 4, "tenant-a")[0] != block_hashes(tokens, 4, "tenant-b")[0]
    assert block_hashes(tokens, 4, "tenant-a") == block_hashes(tokens, 4, "tenant-a")
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool)
    first = make_request("a", tokens + [8], salt="tenant-a")
    assert kv.allocate(first, 9)
    kv.free(first)
    assert kv.match_prefix(make_request("b", tokens + [8], salt="tenant-a"))[1] == 8
    assert kv.match_prefix(make_request("c", tokens + [8], salt="tenant-b"))[1] == 0
    assert kv.match_prefix(make_request("d", tokens + [8]))[1] == 0


def test_allocate_exact_block_ids_and_prefix_hit():
    pool = BlockPool(10, 4)
    kv = KVCacheManager(pool)
    a = make_request("a", range(10))
    assert kv.allocate(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    assert pool.num_cached_blocks == 2  # blocks 0 and 1 are full; block 2 holds 2 tokens
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.match_prefix(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert kv.allocate(b, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_whole_prompt_hit_leaves_last_token_to_compute():
    pool = BlockPool(10, 4)
    kv = KVCacheManager(pool)
    a = make_request("a", range(8))
    kv.allocate(a, 8)
    kv.free(a)
    hits, num_hit = kv.match_prefix(make_request("b", range(8)))
    assert num_hit == 4  # 8 cached, but the last block is recomputed for its logits


def test_free_order_evicts_tail_before_head():
    pool = BlockPool(6, 4)
    pool.record_events = True
    kv = KVCacheManager(pool)
    a = make_request("a", range(12))
    kv.allocate(a, 12)  # blocks 0,1,2 all full and cached
    kv.free(a)
    # Free queue: never-used blocks 3,4,5 first, then a's blocks tail first: 2, 1, 0.
    assert list(pool.free_queue) == [3, 4, 5, 2, 1, 0]
    pool.take_events()
    b = make_request("b", range(100, 116))
    kv.allocate(b, 16)  # needs 4 blocks: 3, 4, 5 and then evicts 2 (a's tail)
    assert kv.block_ids("b") == [3, 4, 5, 2]
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[block_hashes(list(range(12)), 4)[2]]]
    # a's head survives: a new request with a's prefix still hits 2 blocks.
    assert kv.match_prefix(make_request("c", list(range(9))))[1] == 8


def test_hit_on_free_cached_block_revives_it_from_the_queue():
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool)
    a = make_request("a", range(5))
    kv.allocate(a, 5)
    kv.free(a)
    b = make_request("b", range(6))
    hits, _ = kv.match_prefix(b)
    # 4 free blocks, one of which is the hit itself: b needs 1 more, which fits.
    assert kv.can_allocate(b, 2, hits)
    assert kv.allocate(b, 2, hits)
    assert 0 not in pool.free_queue and pool.blocks[0].ref_count == 1
    assert not kv.can_allocate(make_request("c", range(200, 216)), 16)


def test_stored_events_carry_parent_chain_and_tokens():
    pool = BlockPool(4, 2)
    pool.record_events = True
    kv = KVCacheManager(pool)
    kv.allocate(make_request("a", [5, 6, 7, 8, 9]), 5)
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    hashes = block_hashes([5, 6, 7, 8], 2)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
        ([hashes[0]], None, [5, 6]),
        ([hashes[1]], hashes[0], [7, 8]),
    ]
    assert stored[0].to_dict()["type"] == "BlockStored"


def test_reset_only_when_idle_and_emits_all_cleared():
    pool = BlockPool(4, 2)
    pool.record_events = True
    kv = KVCacheManager(pool)
    a = make_request("a", [1, 2, 3])
    kv.allocate(a, 3)
    assert not pool.reset_prefix_cache()
    kv.free(a)
    assert pool.reset_prefix_cache()
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)
    assert pool.num_cached_blocks == 0


def test_double_free_is_caught():
    pool = BlockPool(2, 2)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_hash_collision_is_caught_by_token_check():
    pool = BlockPool(4, 2)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, 1234, None, [1, 2])
    assert pool.get_cached_block(1234, [1, 2]) is block
    assert pool.get_cached_block(1234, [3, 4]) is None


def test_events_are_kept_only_when_asked_for():
    pool = BlockPool(4, 2)
    kv = KVCacheManager(pool)
    a = make_request("a", range(4))
    kv.allocate(a, 4)
    kv.free(a)
    assert pool.take_events() == []  # no consumer: nothing accumulates
    pool.record_events = True
    b = make_request("b", range(10, 14))
    kv.allocate(b, 4)
    assert [type(e) for e in pool.take_events()] == [BlockStored, BlockStored]


def test_a_load_from_a_connector_never_overwrites_a_device_hit():
    from once.engine.kv.memory_connector import HostMemoryConnector

    class HoldsEverything(HostMemoryConnector):
        def lookup(self, hashes):
            return len(hashes)

    pool = BlockPool(3, 4)
    kv = KVCacheManager(pool, HoldsEverything(), load_block=lambda block_id, h: True)
    first = make_request("a", list(range(12)))
    assert kv.allocate(first, 12)
    held = kv.req_blocks.pop("a")
    pool.free_blocks(held)  # head first: the shared first block is the next to go
    second = make_request("b", list(range(4)) + [50 + i for i in range(9)])
    hits, num_hit_tokens = kv.match_prefix(second)
    assert num_hit_tokens == 12 and hits[0] is held[0]
    assert len({b.block_id for b in hits}) == 3  # the device hit kept its own block
    assert hits[0].block_hash == block_hashes(list(range(4)), 4)[0]
