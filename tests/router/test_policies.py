import random
from collections import Counter
from dataclasses import replace

import pytest

from once.protocol.errors import EngineDeadError
from once.router.policies import (
    POLICIES,
    CacheAware,
    DynamoCost,
    PredictedTTFT,
    ReplicaView,
    RequestView,
    SessionAffinity,
    make_policy,
)

BLOCK = 16


def request(num_tokens=160, session_key=None, request_id="r") -> RequestView:
    return RequestView(
        request_id=request_id,
        num_prompt_tokens=num_tokens,
        block_hashes=tuple(range(num_tokens // BLOCK)),
        block_size=BLOCK,
        session_key=session_key,
    )


def replica(index, **fields) -> ReplicaView:
    base = ReplicaView(
        index=index,
        name=f"r{index}",
        healthy=True,
        num_running=0,
        num_queued_prefill_tokens=0,
        num_decode_tokens=0,
        kv_blocks_used=0,
        kv_blocks_total=1000,
        cached_prefix_blocks=0,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
    )
    return replace(base, **fields)


def idle(n):
    return [replica(i) for i in range(n)]


def test_all_issue_policies_are_registered():
    assert set(POLICIES) == {
        "round_robin",
        "least_loaded",
        "power_of_two",
        "cache_aware",
        "dynamo",
        "session_affinity",
        "once",
    }
    for name in POLICIES:
        assert make_policy(name).name == name


def test_make_policy_rejects_unknown_names_and_parameters():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("round_robin", weight=2)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("cache_aware", cache_threshold=-1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_skips_unhealthy_and_fails_cleanly_with_none(name):
    policy = make_policy(name)
    rng = random.Random(0)
    replicas = [replica(0, healthy=False), replica(1), replica(2, healthy=False)]
    for i in range(20):
        assert policy.choose(request(session_key=f"s{i}"), replicas, rng) == 1
    with pytest.raises(EngineDeadError):
        policy.choose(request(), [replica(0, healthy=False)], rng)


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"round_robin"}))
def test_ties_are_broken_at_random_not_by_index(name):
    # Identical idle replicas, no session: every policy must spread first picks.
    picks = Counter()
    for seed in range(60):
        picks[make_policy(name).choose(request(), idle(3), random.Random(seed))] += 1
    assert set(picks) == {0, 1, 2}


def test_same_seed_gives_same_decisions():
    rng_a, rng_b = random.Random(7), random.Random(7)
    a, b = make_policy("power_of_two"), make_policy("power_of_two")
    seq_a = [a.choose(request(), idle(5), rng_a) for _ in range(30)]
    seq_b = [b.choose(request(), idle(5), rng_b) for _ in range(30)]
    assert seq_a == seq_b


def test_round_robin_cycles_and_skips_down_replicas():
    policy = make_policy("round_robin")
    rng = random.Random(0)
    assert [policy.choose(request(), idle(3), rng) for _ in range(4)] == [0, 1, 2, 0]
    replicas = [replica(0), replica(1, healthy=False), replica(2)]
    assert [policy.choose(request(), replicas, rng) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_prefers_fewest_in_flight_then_fewest_tokens():
    policy = make_policy("least_loaded")
    rng = random.Random(0)
    replicas = [replica(0, num_running=3), replica(1, num_running=1), replica(2, num_running=2)]
    assert policy.choose(request(), replicas, rng) == 1
    replicas = [
        replica(0, num_running=1, num_queued_prefill_tokens=500),
        replica(1, num_running=1, num_queued_prefill_tokens=20),
    ]
    assert policy.choose(request(), replicas, rng) == 1


def test_power_of_two_never_picks_the_most_loaded_of_three():
    policy = make_policy("power_of_two")
    replicas = [replica(0, num_running=9), replica(1, num_running=0), replica(2, num_running=1)]
    picks = {policy.choose(request(), replicas, random.Random(s)) for s in range(50)}
    assert 0 not in picks and picks == {1, 2}


def test_cache_aware_follows_the_cache_above_threshold():
    policy = CacheAware()
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.3, 64)
    assert policy.balance_rel_threshold == 1.5
    rng = random.Random(0)
    # 4 of 10 blocks cached (0.4 > 0.3): the cached replica wins despite more load.
    replicas = [replica(0, cached_prefix_blocks=4, num_running=5), replica(1, num_running=0)]
    assert policy.choose(request(160), replicas, rng) == 0
    # 2 of 10 (0.2 <= 0.3): the replica with the smallest cache wins.
    replicas = [
        replica(0, cached_prefix_blocks=2, kv_blocks_used=50),
        replica(1, kv_blocks_used=10),
    ]
    assert policy.choose(request(160), replicas, rng) == 1


def test_cache_aware_balances_when_imbalanced_both_ways():
    policy = CacheAware()
    rng = random.Random(0)
    # diff 70 > 64 and 80 > 10 * 1.5: imbalanced, shortest queue wins over the cache.
    replicas = [replica(0, cached_prefix_blocks=10, num_running=80), replica(1, num_running=10)]
    assert policy.choose(request(160), replicas, rng) == 1
    # diff 60 <= 64: balanced, the cache wins.
    replicas = [replica(0, cached_prefix_blocks=10, num_running=70), replica(1, num_running=10)]
    assert policy.choose(request(160), replicas, rng) == 0
    # the relative test alone: diff 100 > 64 but 1000 < 950 * 1.5, still balanced.
    replicas = [replica(0, cached_prefix_blocks=10, num_running=1000), replica(1, num_running=950)]
    assert policy.choose(request(160), replicas, rng) == 0


def test_dynamo_cost_trades_cache_credit_against_active_blocks():
    policy = DynamoCost()
    r0 = replica(0, cached_prefix_blocks=8, kv_blocks_used=20)
    r1 = replica(1, kv_blocks_used=12)
    # r0: prefill (160 - 128) / 16 = 2, decode 20 + 10 -> 32; r1: 10 + 12 + 10 = 32 -> tie
    assert policy.cost(request(160), r0) == 32 == policy.cost(request(160), r1)
    r1 = replica(1, kv_blocks_used=11)
    assert policy.choose(request(160), [r0, r1], random.Random(0)) == 1
    # weight 2 doubles the cache credit: r0 = 4 + 30 = 34 vs r1 = 20 + 21 = 41
    heavy = DynamoCost(overlap_score_weight=2.0)
    assert heavy.choose(request(160), [r0, r1], random.Random(0)) == 0


def test_dynamo_temperature_samples_but_favours_low_cost():
    policy = DynamoCost(temperature=1.0)
    replicas = [replica(0, kv_blocks_used=0), replica(1, kv_blocks_used=3)]
    picks = Counter(policy.choose(request(), replicas, random.Random(s)) for s in range(300))
    assert picks[0] > picks[1] > 0


def test_session_affinity_is_sticky_and_moves_only_the_dead_replicas_sessions():
    policy = SessionAffinity()
    rng = random.Random(0)
    replicas = idle(4)
    homes = {k: policy.choose(request(session_key=k), replicas, rng) for k in map(str, range(200))}
    assert len(set(homes.values())) == 4
    again = {k: policy.choose(request(session_key=k), replicas, rng) for k in homes}
    assert again == homes
    replicas[2] = replica(2, healthy=False)
    moved = {k: policy.choose(request(session_key=k), replicas, rng) for k in homes}
    assert all(moved[k] == homes[k] for k in homes if homes[k] != 2)
    assert all(moved[k] != 2 for k in homes)


def test_once_policy_weighs_cache_against_queue_at_each_speed():
    policy = PredictedTTFT(prefix_affinity_margin=0.0)  # no prefix affinity: TTFT alone
    rng = random.Random(0)
    # r0 holds 9 of 10 blocks but has 1000 tokens queued; r1 is idle and cold.
    r0 = replica(0, cached_prefix_blocks=9, num_queued_prefill_tokens=1000)
    r1 = replica(1)
    assert policy.predicted_ttft_s(request(160), r0) == pytest.approx(1.016)
    assert policy.predicted_ttft_s(request(160), r1) == pytest.approx(0.16)
    assert policy.choose(request(160), [r0, r1], rng) == 1
    # A half-speed replica looks twice as far away.
    slow = replica(0, prefill_tokens_per_s=500.0)
    fast = replica(1, num_queued_prefill_tokens=100)
    assert policy.choose(request(160), [slow, fast], rng) == 1


def test_once_policy_counts_a_prefix_in_a_lower_kv_tier_as_its_load_time():
    policy = PredictedTTFT(prefix_affinity_margin=0.0)
    # 8 of 10 blocks in host memory, loaded in 0.02 s: 32 tokens left to prefill.
    tiered = replica(0, tier_prefix_blocks=(6, 2), tier_load_s=0.02)
    assert tiered.matched_prefix_blocks == 8
    assert policy.predicted_ttft_s(request(160), tiered) == pytest.approx(0.032 + 0.02)
    # Against a device hit of 2 blocks (0.128 s of prefill) the tier hit wins.
    device = replica(1, cached_prefix_blocks=2)
    assert policy.choose(request(160), [tiered, device], random.Random(0)) == 0
    # A load slower than recomputing loses to it.
    slow_load = replica(0, tier_prefix_blocks=(8,), tier_load_s=1.0)
    assert policy.choose(request(160), [slow_load, replica(1)], random.Random(0)) == 1


def test_once_policy_keeps_a_keyless_request_with_its_prefix_unless_far_slower():
    policy = PredictedTTFT()  # prefix_affinity_margin 0.9: leave only for 10x faster
    rng = random.Random(0)
    # r0 holds 9 of 10 blocks behind 1000 queued tokens (prefill 1.01 s); idle r1 would
    # take 0.16 s: 6x faster, not 10x, so the request goes where its history is.
    r0 = replica(0, cached_prefix_blocks=9, num_queued_prefill_tokens=1000)
    assert policy.choose(request(160), [r0, replica(1)], rng) == 0
    # Behind 10,000 queued tokens r0 is 60x slower: the request moves.
    r0 = replica(0, cached_prefix_blocks=9, num_queued_prefill_tokens=10_000)
    assert policy.choose(request(160), [r0, replica(1)], rng) == 1
    # Two replicas hold the same deepest prefix: the home is not picked by index.
    picks = set()
    for seed in range(20):
        holders = [replica(i, cached_prefix_blocks=9) for i in range(2)]
        cold = replica(2, num_queued_prefill_tokens=0)
        picks.add(policy.choose(request(160), [*holders, cold], random.Random(seed)))
    assert picks == {0, 1}


def test_once_policy_keeps_a_session_home_unless_clearly_slower():
    policy = PredictedTTFT(affinity_margin=0.25)
    rng = random.Random(0)
    home = policy.choose(request(160, session_key="s"), idle(2), rng)
    other = 1 - home
    # The other replica is 20% faster: within the margin, the session stays home.
    replicas = [replica(home, num_queued_prefill_tokens=40), replica(other)]
    replicas.sort(key=lambda r: r.index)
    assert policy.choose(request(160, session_key="s"), replicas, rng) == home
    # Now 50% faster: the session moves, and its new home sticks.
    replicas = [replica(home, num_queued_prefill_tokens=160), replica(other)]
    replicas.sort(key=lambda r: r.index)
    assert policy.choose(request(160, session_key="s"), replicas, rng) == other
    assert policy.choose(request(160, session_key="s"), idle(2), rng) == other


def test_once_policy_does_not_leave_a_cached_home_for_its_pending_decodes():
    # With the decode term on (the default is 0), it still never moves a session.
    policy = PredictedTTFT(affinity_margin=0.25, decode_weight=0.5)
    rng = random.Random(0)
    home = policy.choose(request(160, session_key="s"), idle(2), rng)
    other = 1 - home
    # Home: 9 of 10 blocks cached, 1000 decode tokens pending (5 s of decode at 100/s).
    # Other: idle and cold. The decode term makes home's TTFT look far longer, yet
    # decodes do not queue ahead of a chunked prefill: the session stays on its cache.
    busy_home = replica(home, cached_prefix_blocks=9, num_decode_tokens=1000, num_running=2)
    replicas = sorted([busy_home, replica(other)], key=lambda r: r.index)
    assert policy.predicted_ttft_s(request(160), busy_home) > policy.predicted_ttft_s(
        request(160), replicas[other]
    )
    assert policy.choose(request(160, session_key="s"), replicas, rng) == home
    # A new session (no home) is still placed away from the busy batch.
    assert policy.choose(request(160, session_key="new"), replicas, rng) == other


def test_once_policy_does_not_move_a_session_on_a_speed_swing_alone():
    policy = PredictedTTFT()
    rng = random.Random(0)
    home = policy.choose(request(160, session_key="s"), idle(2), rng)
    other = 1 - home
    # Home holds 5 of the 10 blocks; the other replica measures 5x faster and is cold.
    # Per replica's own speed the other promises the first token in 0.4 of the time, but
    # the work ahead is 80 tokens at home against 160 there: the session stays home.
    swing = [
        replica(home, cached_prefix_blocks=5, prefill_tokens_per_s=200.0),
        replica(other, prefill_tokens_per_s=1000.0),
    ]
    swing.sort(key=lambda r: r.index)
    assert policy.predicted_prefill_s(request(160), swing[other]) < 0.5 * (
        policy.predicted_prefill_s(request(160), swing[home])
    )
    assert policy.choose(request(160, session_key="s"), swing, rng) == home
    # A queue at home of more than twice the other's work (80 + 300 > 2 x 160) moves it.
    queued = [
        replica(home, cached_prefix_blocks=5, num_queued_prefill_tokens=300),
        replica(other),
    ]
    queued.sort(key=lambda r: r.index)
    assert policy.choose(request(160, session_key="s"), queued, rng) == other


def test_once_policy_spreads_new_sessions_whatever_the_measured_speeds():
    policy = PredictedTTFT()
    rng = random.Random(0)
    # r0 measures 1.5x faster and both are idle: per predicted TTFT every new session
    # would go to r0; by resident sessions they alternate.
    views = [replica(0, prefill_tokens_per_s=1500.0), replica(1)]
    homes = [policy.choose(request(160, session_key=f"s{i}"), views, rng) for i in range(6)]
    assert sorted(Counter(homes).values()) == [3, 3]
    # A session's later calls stay home (its prefix cached there).
    assert policy.choose(request(160, session_key="s1"), views, rng) == homes[1]


def test_sessions_that_no_longer_fit_the_caches_do_not_count_as_resident():
    policy = PredictedTTFT()
    rng = random.Random(0)
    small = [replica(i, kv_blocks_total=20) for i in range(2)]  # 320 tokens each
    # Three old 200-token sessions homed on r0 (r1 down meanwhile)...
    for i in range(3):
        assert policy.choose(request(160 + 40, session_key=f"old{i}"), small[:1], rng) == 0
    # ...then two recent 300-token sessions on r1 fill both caches (600 of 640 tokens):
    # the old ones are evicted, r1 holds the most resident sessions, a new one goes to r0.
    for i in range(2):
        policy.choose(
            request(300, session_key=f"new{i}"), [replace(small[0], healthy=False), small[1]], rng
        )
    assert policy.choose(request(160, session_key="next"), small, rng) == 0
