import numpy as np
import pytest

from once.sim.capacity import (
    arrival_scale_for_load,
    bound_cached_tokens,
    shared_lru_hit_ratio,
    total_work_s,
)
from once.sim.cluster import Cluster
from once.sim.metrics import percentile, summarize
from tests.sim.conftest import RoundRobinStandIn, make_profile, make_request


def test_unlimited_bound_counts_every_block_seen_before():
    requests = [
        make_request("a", 0.0, (1, 2)),
        make_request("b", 1.0, (1, 2, 3)),
        make_request("c", 2.0, (1, 2), num_prompt=32),  # fully seen: one token computed
        make_request("d", 3.0, (4, 2)),  # same block 2, different prefix: no hit
    ]
    assert bound_cached_tokens(requests, 16) == [0, 32, 31, 0]


def test_shared_lru_lies_between_no_cache_and_the_bound():
    requests = [make_request(str(i), i, (i % 3, 100 + i % 3)) for i in range(12)]
    unlimited = shared_lru_hit_ratio(requests, 16, capacity=10**6)
    bound = sum(bound_cached_tokens(requests, 16)) / sum(r.num_prompt_tokens for r in requests)
    assert unlimited == pytest.approx(bound)
    assert shared_lru_hit_ratio(requests, 16, capacity=2) == 0.0  # cycle of 3 thrashes LRU


def test_arrival_scale_hits_the_requested_load():
    profile = make_profile()
    requests = [make_request(str(i), float(i), (i,), num_output=10) for i in range(11)]
    work_s = total_work_s(requests, profile)
    scale = arrival_scale_for_load(requests, profile, num_replicas=2, load=0.5)
    assert work_s / (2 * 10.0 * scale) == pytest.approx(0.5)
    assert arrival_scale_for_load(requests, profile, 2, 1.0) == pytest.approx(scale / 2)
    with pytest.raises(ValueError):
        arrival_scale_for_load(requests, profile, 2, 0.0)
    with pytest.raises(ValueError):
        arrival_scale_for_load(requests[:1], profile, 2, 0.5)  # no time span


def test_percentile_matches_numpy():
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert np.isnan(percentile([], 50))


def test_summary_counts_hits_slo_and_imbalance():
    profile = make_profile(ttft_slo_s=0.05, tpot_slo_s=0.05)
    requests = [
        make_request("a", 0.0, (1, 2), num_output=3),
        make_request("b", 1.0, (1, 2), num_output=3),
        make_request("c", 2.0, (7,), num_output=2),
    ]
    result = Cluster([profile, profile], RoundRobinStandIn()).run(requests)
    row = summarize(result, requests, ttft_slo_s=0.05, tpot_slo_s=0.05)
    assert row["hit_ratio"] == 0.0  # round-robin put the repeat on the other replica
    assert row["hit_ratio_bound"] == pytest.approx(31 / 80)
    assert row["slo_attainment"] == 1.0 and row["num_rejected"] == 0
    busy = [r.busy_s for r in result.replicas]
    assert row["load_imbalance"] == pytest.approx(max(busy) / (sum(busy) / 2))
    strict = summarize(result, requests, ttft_slo_s=0.001, tpot_slo_s=0.05)
    assert strict["slo_attainment"] == 0.0 and strict["goodput_rps"] == 0.0
