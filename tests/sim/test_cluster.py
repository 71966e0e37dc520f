import random

import pytest

from once.router.policies import make_policy
from once.sim.cluster import Cluster
from tests.sim.conftest import RoundRobinStandIn, make_profile, make_request


def test_single_request_timing_follows_the_cost_model(profile):
    request = make_request("a", 1.0, (1, 2), num_output=3)  # 32 prompt tokens
    result = Cluster([profile], RoundRobinStandIn()).run([request])
    (state,) = result.states
    prefill_s = 0.01 + 32 * 1e-4 + 32 * (0 + 33 / 2) * 1e-8
    assert state.first_token_s - 1.0 == pytest.approx(prefill_s, rel=1e-12)
    decode_s = 2 * (0.01 + 0.001) + (33 + 34) * 1e-6  # two steps; contexts 33 and 34
    assert state.finish_s - state.first_token_s == pytest.approx(decode_s, rel=1e-12)
    assert result.replicas[0].busy_s == pytest.approx(prefill_s + decode_s, rel=1e-12)


def test_repeated_prefix_hits_the_cache_on_the_same_replica(profile):
    first = make_request("a", 0.0, (1, 2, 3), num_output=2)
    second = make_request("b", 5.0, (1, 2, 9), num_output=2)
    again = make_request("c", 6.0, (1, 2, 3), num_output=2)  # whole prompt cached
    result = Cluster([profile], RoundRobinStandIn()).run([first, second, again])
    cached = {s.request.request_id: s.num_cached_tokens for s in result.states}
    assert cached == {"a": 0, "b": 32, "c": 47}  # at least one token is always computed
    ttft = {s.request.request_id: s.first_token_s - s.arrival_s for s in result.states}
    assert ttft["c"] < ttft["b"] < ttft["a"]


def test_the_token_budget_chunks_a_long_prefill():
    profile = make_profile(max_num_batched_tokens=64, kv_blocks=64)
    request = make_request("a", 0.0, tuple(range(10)), num_output=1)  # 160 tokens: 3 steps
    result = Cluster([profile], RoundRobinStandIn()).run([request])
    chunks = [(64, 0), (64, 64), (32, 128)]
    expected = sum(0.01 + profile.prefill_s(n, done) for n, done in chunks)
    assert result.states[0].first_token_s == pytest.approx(expected, rel=1e-12)
    assert result.states[0].finish_s == result.states[0].first_token_s


def test_kv_capacity_makes_requests_wait_and_rejects_the_impossible():
    profile = make_profile(kv_blocks=4)
    big = make_request("big", 0.0, (1, 2, 3), num_output=8)  # 3 prompt + 1 output block
    next_one = make_request("next", 0.001, (5, 6), num_output=1)
    too_big = make_request("huge", 0.002, tuple(range(100, 105)), num_output=1)
    result = Cluster([profile], RoundRobinStandIn()).run([big, next_one, too_big])
    states = {s.request.request_id: s for s in result.states}
    assert states["huge"].rejected and states["huge"].first_token_s is None
    # "next" fits only once "big" has released its blocks.
    assert states["next"].first_token_s > states["big"].finish_s


def test_a_session_call_arrives_think_time_after_the_previous_one_finished(profile):
    first = make_request("s#0", 0.0, (1,), num_output=3, session_key="s")
    follow = make_request(
        "s#1", 999.0, (1, 2), num_output=3, session_key="s", after="s#0", think_s=2.5
    )
    result = Cluster([profile], RoundRobinStandIn()).run([first, follow])
    states = {s.request.request_id: s for s in result.states}
    assert states["s#1"].arrival_s == pytest.approx(states["s#0"].finish_s + 2.5)
    assert states["s#1"].num_cached_tokens == 16
    with pytest.raises(ValueError, match="unknown request"):
        Cluster([profile], RoundRobinStandIn()).run([follow])


def _random_workload(seed: int, num: int = 60):
    rng = random.Random(seed)
    requests, time_s = [], 0.0
    for i in range(num):
        time_s += rng.expovariate(40.0)
        root = rng.randrange(4)
        hashes = (root, *(1000 * root + rng.randrange(3) for _ in range(rng.randrange(1, 4))))
        hashes += tuple(rng.randrange(10**9) for _ in range(rng.randrange(0, 3)))
        requests.append(make_request(f"r{i}", time_s, hashes, num_output=rng.randrange(1, 40)))
    return requests


@pytest.mark.parametrize("policy_name", ["least_loaded", "once", "dynamo"])
def test_decode_spans_give_the_same_run_as_step_by_step(policy_name):
    # Spans are an optimization: decisions, hits and every timestamp must match the
    # one-event-per-step reference.
    profile = make_profile(kv_blocks=12, max_num_seqs=6)
    requests = _random_workload(seed=7)
    runs = [
        Cluster([profile] * 3, make_policy(policy_name), seed=1, span_decodes=spans).run(requests)
        for spans in (True, False)
    ]
    fast, slow = runs
    assert [d.replica for d in fast.decisions] == [d.replica for d in slow.decisions]
    for a, b in zip(fast.states, slow.states, strict=True):
        assert a.num_cached_tokens == b.num_cached_tokens
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-9)


def test_cluster_needs_a_replica():
    with pytest.raises(ValueError):
        Cluster([], RoundRobinStandIn())
