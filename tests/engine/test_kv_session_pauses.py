"""Session-aware KV: pluggable device-pool eviction, keeps for short pauses, demotion and
offload for long ones, and the pause hint's path from request metadata to the engine."""

import json

import pytest

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.kv.blocks import BlockPool
from once.engine.kv.manager import KVCacheManager
from once.engine.kv.session_pauses import (
    KEEP_MARGIN_S,
    KEEP_SLACK,
    WAITING_KEEP_S,
    SessionPauses,
)
from once.engine.request import Request
from once.gateway.pause_hints import METADATA_KEY, expected_pause_s, pause_table
from once.kv_eviction.policies import eviction_factory
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import InvalidRequestError
from tests.engine.test_engine_parity import GREEDY, prompts


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_request(rid, tokens, session=None):
    req = GenerateRequest(rid, tuple(tokens), SamplingParams(max_tokens=4), session_key=session)
    return Request(req, eos_token_ids=(), max_len=1024)


def run_and_free(kv, rid, tokens, session=None):
    request = make_request(rid, tokens, session)
    hits, _ = kv.match_prefix(request)
    assert kv.allocate(request, len(tokens) - len(hits) * kv.block_size, hits)
    kv.free(request)
    return request


def cached_ids(pool, request):
    return [pool.cached[h].block_id for h in request.block_hashes if h in pool.cached]


@pytest.mark.parametrize("policy", ["lru", "leaf-lru", "lfu-da", "reuse"])
def test_every_sim_policy_runs_the_device_pool_and_keeps_a_shared_prefix(policy):
    clock = Clock()
    pool = BlockPool(8, 4, policy_factory=eviction_factory(policy), clock=clock)
    kv = KVCacheManager(pool)
    shared = list(range(8))
    for i in range(20):  # requests sharing 2 head blocks, each with 2 blocks of its own
        clock.now += 1
        run_and_free(kv, f"r{i}", shared + [1000 + 10 * i + j for j in range(8)] + [7])
    assert pool.num_free_blocks == 8 and pool.num_evictions > 0
    # The head, hit by every request, is still cached: prefix-aware or recency, it stays.
    assert kv.match_prefix(make_request("probe", shared + [5]))[1] == 8


def test_empty_blocks_are_taken_before_any_cached_block_is_evicted():
    pool = BlockPool(6, 4)
    kv = KVCacheManager(pool)
    run_and_free(kv, "a", range(9))  # 2 cached blocks, the third (1 token) freed empty
    b = make_request("b", range(100, 112))
    assert kv.allocate(b, 12)
    assert pool.num_evictions == 0  # 3 empty blocks were there: nothing of a's went


def test_a_kept_session_outlives_newer_free_blocks_until_its_deadline():
    clock = Clock()
    pool = BlockPool(6, 4, clock=clock)
    kv = KVCacheManager(pool)
    a = run_and_free(kv, "a", range(9))  # blocks of a: the oldest free cached ones
    pool.keep(a.block_hashes, until=clock.now + 5)
    run_and_free(kv, "b", range(100, 109))
    c = make_request("c", range(200, 209))
    assert kv.allocate(c, 9)  # needs 3: the empty ones, then b's (LRU would take a's)
    assert cached_ids(pool, a) == [0, 1] and pool.num_keeps_broken == 0
    kv.free(c)
    clock.now += 6  # the deadline passed: a is ordinary LRU again, and goes first
    d = make_request("d", range(300, 324))
    assert kv.allocate(d, 24)
    assert cached_ids(pool, a) == []


def test_when_only_kept_blocks_are_left_the_session_expected_back_last_loses_its_keep():
    clock = Clock()
    pool = BlockPool(5, 4, clock=clock)
    kv = KVCacheManager(pool)
    a = run_and_free(kv, "a", range(9))  # blocks 0, 1 cached; 2 freed empty
    b = run_and_free(kv, "b", range(100, 108))  # blocks 3, 4 cached
    pool.keep(a.block_hashes, until=clock.now + 3)
    pool.keep(b.block_hashes, until=clock.now + 30)
    c = make_request("c", range(200, 205))
    assert kv.can_allocate(c, 5)  # kept blocks never make a request wait
    assert kv.allocate(c, 5)
    assert cached_ids(pool, a) == [0, 1] and cached_ids(pool, b) == [3]
    assert pool.num_keeps_broken == 2 and not pool.kept.keys() & set(b.block_hashes)


def test_a_hit_ends_the_keep_and_a_demoted_session_goes_first():
    clock = Clock()
    pool = BlockPool(6, 4, clock=clock)
    kv = KVCacheManager(pool)
    a = run_and_free(kv, "a", range(9))
    b = run_and_free(kv, "b", range(100, 109))
    pool.keep(a.block_hashes, until=clock.now + 5)
    run_and_free(kv, "a2", list(range(9)) + [9, 10])  # a's next call hits: the keep ends
    assert not pool.kept and not pool.keep_until
    assert pool.demote(b.block_hashes) == 2  # b: newest in LRU order, but demoted
    c = make_request("c", range(200, 216))
    assert kv.allocate(c, 16)  # 2 empty blocks, then 2 evicted: b's, not a's
    assert cached_ids(pool, b) == [] and len(cached_ids(pool, a)) == 2


class RecordingConnector:
    wants_evicted = True

    def __init__(self):
        self.host: dict[int, object] = {}
        self.prefetched: list[list[int]] = []

    def lookup(self, hashes):
        count = 0
        for block_hash in hashes:
            if block_hash not in self.host:
                break
            count += 1
        return count

    def evicted(self, block_hash, k, v):
        self.host[block_hash] = (k, v)

    def prefetch(self, hashes):
        self.prefetched.append(list(hashes))
        return object()


def test_short_pause_keeps_long_pause_offloads_demotes_and_prefetches_before_it_ends():
    clock = Clock()
    pool = BlockPool(8, 4, clock=clock)
    kv = KVCacheManager(pool)
    connector = RecordingConnector()
    pauses = SessionPauses(pool, connector, lambda h: ("k", "v"), keep_s=10.0, clock=clock)
    a = run_and_free(kv, "a", range(9), session="s-a")
    b = run_and_free(kv, "b", range(100, 109), session="s-b")
    pauses.finished("s-a", a.block_hashes)
    pauses.finished("s-b", b.block_hashes)
    pauses.pause("s-a", 2.0)
    assert set(pool.kept) == set(a.block_hashes)
    assert pool.keep_until[a.block_hashes[0]] == (
        clock.now + 2.0 * KEEP_SLACK + KEEP_MARGIN_S,
        clock.now + 2.0,
    )
    pauses.pause("s-b", 60.0)
    assert set(connector.host) == set(b.block_hashes)  # written down at once (write-back)
    assert list(pool.policy) == b.block_hashes[::-1]  # demoted: first to go, tail first
    connector.host.pop(b.block_hashes[1])  # the host tier lost one: it must come back
    clock.now += 58.0
    pauses.run_due()
    assert connector.prefetched == []  # not yet: PREFETCH_LEAD_S before the end
    clock.now += 1.5
    pauses.run_due()
    assert connector.prefetched == [b.block_hashes[1:]]
    pauses.pause("unknown", 1.0)
    assert pauses.counters["kv_pause_unknown_sessions"] == 1


def test_a_returning_hinted_session_is_kept_while_it_waits_and_an_unhinted_one_is_not():
    clock = Clock()
    pool = BlockPool(8, 4, clock=clock)
    kv = KVCacheManager(pool)
    pauses = SessionPauses(pool, None, lambda h: None, keep_s=10.0, clock=clock)
    a = run_and_free(kv, "a", range(9), session="s-a")
    pauses.finished("s-a", a.block_hashes)
    pauses.arrived("s-a")  # never hinted: left to the policy
    assert not pool.kept
    pauses.pause("s-a", 0.5)
    clock.now += 10  # the pause ran long: the keep lapsed before the next call came
    pool.get_new_blocks(0)
    pauses.arrived("s-a")
    assert set(pool.kept) == set(a.block_hashes)
    assert pool.keep_until[a.block_hashes[0]] == (clock.now + WAITING_KEEP_S, clock.now)
    hits, _ = kv.match_prefix(make_request("a2", list(range(9)) + [5], session="s-a"))
    pool.touch(hits)  # admitted: the hit ends the keep
    assert not pool.kept


def test_pause_table_parses_the_metadata_field_and_rejects_bad_values_naming_the_param():
    table = pause_table({METADATA_KEY: json.dumps({"bash": 3.5, "*": 1})})
    assert table == {"bash": 3.5, "*": 1.0}
    assert pause_table({"other": "x"}) is None and pause_table(None) is None
    for bad in ("not json", "[1, 2]", json.dumps({"bash": -1}), json.dumps({"bash": "3"})):
        with pytest.raises(InvalidRequestError) as caught:
            pause_table({METADATA_KEY: bad})
        assert caught.value.param == f"metadata.{METADATA_KEY}"


def test_expected_pause_is_the_longest_called_tool_star_the_unknown_and_reply_the_text():
    table = {"bash": 3.0, "edit": 0.5, "*": 1.0}
    calls = [{"type": "function_call", "name": "edit"}, {"type": "function_call", "name": "bash"}]
    assert expected_pause_s(table, calls) == 3.0
    assert expected_pause_s(table, [{"type": "function_call", "name": "new_tool"}]) == 1.0
    assert expected_pause_s(table, [{"type": "message", "content": []}]) is None  # an answer
    assert expected_pause_s({"(reply)": 4.0}, [{"type": "message"}]) == 4.0  # a text action
    assert expected_pause_s({"*": 2.0}, [{"type": "shell_call"}]) == 2.0


# -- the engine --------------------------------------------------------------------------

FIRST, OTHER, BIG = prompts(9, [22])[0], prompts(11, [14])[0], prompts(12, [30])[0]


def run_session(engine, request_id, tokens, session=None):
    request = GenerateRequest(request_id, tuple(tokens), GREEDY, session_key=session)
    return engine.generate([request])[request_id]


@pytest.mark.parametrize("hinted", [False, True])
def test_a_short_pause_hint_keeps_the_paused_session_where_lru_would_evict_it(
    tiny_model_dir, hinted
):
    config = EngineConfig(
        model=str(tiny_model_dir), block_size=4, num_kv_blocks=16, kv_pause_hints=True
    )
    engine = LLMEngine(config)
    run_session(engine, "first", FIRST, session="s")  # 6 cached blocks, the oldest
    if hinted:
        engine.pause_session("s", 1.0)
    run_session(engine, "other", OTHER)  # 4 more cached blocks, newer
    run_session(engine, "big", BIG)  # takes the 6 empty blocks and evicts 3 cached ones
    returning = run_session(engine, "returning", FIRST + [7, 8, 9], session="s")
    assert returning[0].num_cached_tokens == (20 if hinted else 12)  # 20: all the prompt has
    stats = engine.stats()
    assert stats["kv_pause_kept_blocks"] == (6 if hinted else 0)
    assert stats["num_kv_keeps_broken"] == 0


def test_a_long_pause_hint_offloads_at_once_in_write_back(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir),
        block_size=4,
        num_kv_blocks=16,
        kv_host_blocks=64,
        kv_offload="write_back",
        kv_pause_hints=True,
    )
    engine = LLMEngine(config)
    run_session(engine, "first", FIRST, session="s")
    assert engine.stats()["kv_tier_host_saved_blocks"] == 0  # write-back: nothing evicted
    engine.pause_session("s", 60.0)
    stats = engine.stats()
    assert stats["kv_pause_offloaded_blocks"] == 6 and stats["kv_tier_host_saved_blocks"] == 6
    assert stats["kv_pause_demoted_blocks"] == 6
    engine.close()


def test_hints_are_counted_and_ignored_unless_the_engine_takes_them(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=16))
    run_session(engine, "first", FIRST, session="s")
    engine.pause_session("s", 1.0)
    stats = engine.stats()
    assert stats["num_pause_hints_ignored"] == 1 and stats["kv_pause_hints"] == 0
    assert not engine.pool.kept
