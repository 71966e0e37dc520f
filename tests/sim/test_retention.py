import pytest

from once.sim.capacity import bound_cached_tokens
from once.sim.retention import retention_report, reuse_gaps
from once.sim.workload import SimRequest, load_mooncake

BLOCK = 4


def request(name: str, arrival_s: float, hashes: tuple[int, ...], num_tokens: int | None = None):
    num_tokens = len(hashes) * BLOCK if num_tokens is None else num_tokens
    return SimRequest(name, arrival_s, num_tokens, 1, hashes)


# Conversation A returns after 10 s, B after 100 s; C never returns. Every prompt is whole
# blocks, so the last block's last token is never cached (as the bound counts).
TRACE = [
    request("a1", 0.0, (1, 2)),
    request("b1", 5.0, (3, 4, 5)),
    request("c1", 8.0, (6, 7, 8, 9)),
    request("a2", 10.0, (1, 2, 10)),
    request("b2", 105.0, (3, 4, 5, 11)),
]


def test_reuse_gaps_count_the_tokens_the_unlimited_cache_hits():
    gaps = reuse_gaps(TRACE, BLOCK)
    assert sorted(gaps) == [(10.0, 4), (10.0, 4), (100.0, 4), (100.0, 4), (100.0, 4)]
    assert sum(tokens for _, tokens in gaps) == sum(bound_cached_tokens(TRACE, BLOCK))


def test_a_partial_last_block_is_counted_as_the_bound_counts_it():
    trace = [request("x1", 0.0, (1, 2), num_tokens=6), request("x2", 1.0, (1, 2), num_tokens=6)]
    assert reuse_gaps(trace, BLOCK) == [(1.0, 4), (1.0, 1)]
    assert sum(bound_cached_tokens(trace, BLOCK)) == 5


def test_retention_report_turns_capacity_into_a_keep_time_and_back():
    # 11 distinct blocks over 105 s.
    report = retention_report(TRACE, BLOCK, num_blocks=2)
    rate = 11 / 105
    assert report["new_blocks_per_s"] == pytest.approx(rate)
    assert report["retention_s"] == pytest.approx(2 / rate)  # 19.1 s: A's return only
    assert report["hit_share_within_retention"] == pytest.approx(8 / 20)
    assert report["gap_at_target_s"] == 100.0
    assert report["blocks_for_target"] == pytest.approx(100 * rate)
    assert retention_report(TRACE, BLOCK, num_blocks=11)["hit_share_within_retention"] == 1.0


def test_retention_report_rejects_bad_input():
    with pytest.raises(ValueError):
        retention_report([], BLOCK, 10)
    with pytest.raises(ValueError):
        retention_report(TRACE, BLOCK, 0)
    with pytest.raises(ValueError):
        retention_report(TRACE, BLOCK, 10, target=1.5)


def test_on_the_mooncake_trace_the_ceiling_does_not_depend_on_the_time_scale():
    requests = load_mooncake(None, minutes=5)
    fast = [
        SimRequest(r.request_id, r.arrival_s / 3, r.num_prompt_tokens, 1, r.block_hashes)
        for r in requests
    ]
    slow, quick = (retention_report(trace, 512, 2000) for trace in (requests, fast))
    assert quick["hit_share_within_retention"] == pytest.approx(slow["hit_share_within_retention"])
    assert quick["blocks_for_target"] == pytest.approx(slow["blocks_for_target"])
