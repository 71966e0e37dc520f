import json
import random

import pytest

from once.router.disagg.split import IDLE, PREFILL_BUSY, SHORT, SPLIT, SplitPolicy
from once.router.policies import ReplicaView, RequestView
from once.sim import main
from once.sim.cluster import Cluster
from once.sim.compare import Scenario
from once.sim.disagg.compare import PDGrid, compare_pd, split_windows
from once.sim.disagg.transfer import PDConfig
from once.sim.latency import LatencyHistogram
from tests.sim.conftest import RoundRobinStandIn, make_profile, make_request
from tests.sim.test_cli import _mooncake_file

# 1 KB of KV per token over 1 MB/s: 1 ms a token, so transfer times are plain to read.
LINKED = dict(kv_bytes_per_block=16_000, transfer_bandwidth_bytes_per_s=1e6)


def _view(index, *, running=1, queued=0, cached=0, speed=1000.0, healthy=True):
    return ReplicaView(
        index=index, name=f"r{index}", healthy=healthy, num_running=running,
        num_queued_prefill_tokens=queued, num_decode_tokens=0, kv_blocks_used=0,
        kv_blocks_total=100, cached_prefix_blocks=cached, prefill_tokens_per_s=speed,
        decode_tokens_per_s=100.0,
    )  # fmt: skip


def _request(num_prompt):
    return RequestView("r", num_prompt, tuple(range(num_prompt // 16)), 16)


def test_split_policy_sends_only_long_uncached_prompts_past_a_busy_decoder():
    policy = SplitPolicy(min_uncached_tokens=256, max_slowdown=1.5)
    rng = random.Random(0)
    prefills = [_view(0, running=0, queued=800), _view(1, running=0)]
    long_prompt = _request(512)
    decision = policy.decide(long_prompt, _view(2), prefills, rng)
    assert (decision.reason, decision.prefill_index) == (SPLIT, 1)  # the shorter queue
    assert decision.num_uncached_tokens == 512
    # Its cached prefix on the decode replica leaves 192 tokens: short.
    assert policy.decide(long_prompt, _view(2, cached=20), prefills, rng).reason == SHORT
    assert policy.decide(long_prompt, _view(2, running=0), prefills, rng).reason == IDLE
    backed_up = [_view(0, running=0, queued=2000)]
    assert policy.decide(long_prompt, _view(2), backed_up, rng).reason == PREFILL_BUSY
    # ... unless the TTFT budget allows the wait.
    generous = SplitPolicy(min_uncached_tokens=256, ttft_budget_s=5.0)
    assert generous.decide(long_prompt, _view(2), backed_up, rng).reason == SPLIT


def test_a_split_request_is_prefilled_on_the_prefill_replica_and_decoded_from_its_kv():
    profile = make_profile(**LINKED)
    pd = PDConfig(1, SplitPolicy(min_uncached_tokens=64, min_decoding=0, ttft_budget_s=1.0))
    requests = [make_request("a", 0.0, tuple(range(1, 9)), num_output=5)]  # 128 tokens
    result = Cluster([profile] * 2, RoundRobinStandIn(), pd=pd).run(requests)
    (state,) = result.states
    assert state.replica == 1 and result.decisions[0].prefill_replica == 0
    prefill, decode = result.replicas
    assert prefill.num_prefilled_tokens == 128
    assert decode.num_prefilled_tokens == 1  # the last prompt token, for the first output
    assert state.num_transferred_tokens == 127
    assert result.pd["transferred_bytes"] == 128 * 1000
    # TTFT = the prefill step + the last chunk's transfer (128 ms) + a decode-side step.
    prefill_s = profile.step_base_s + profile.prefill_s(128, 0)
    decode_step_s = profile.step_base_s + profile.prefill_s(1, 127)
    ttft = state.first_token_s - state.arrival_s
    assert ttft == pytest.approx(prefill_s + 0.128 + decode_step_s)
    assert state.num_generated == 5


def test_colocated_long_prefills_stall_decodes_that_disaggregation_spares():
    profile = make_profile(**LINKED, max_num_batched_tokens=2048, kv_blocks=400)
    requests = [make_request("talk", 0.0, (1,), num_output=400)]
    requests += [
        make_request(f"doc{i}", 0.05 + i * 0.2, tuple(range(100 * i + 10, 100 * i + 110)))
        for i in range(5)
    ]  # 1,600-token prompts while "talk" decodes
    colocated = Cluster([profile], RoundRobinStandIn()).run(requests)
    split = PDConfig(1, SplitPolicy(min_uncached_tokens=512, ttft_budget_s=5.0))
    pd = Cluster([profile] * 2, RoundRobinStandIn(), pd=split).run(requests)
    assert pd.pd["num_split"] == 5
    itl_colocated = LatencyHistogram().merge(r.itl for r in colocated.replicas)
    itl_pd = LatencyHistogram().merge(r.itl for r in pd.replicas)
    assert itl_pd.percentile(100) < 0.5 * itl_colocated.percentile(100)


def test_a_prefill_replica_fetches_the_prefix_the_decode_side_holds():
    profile = make_profile(**LINKED)
    pd = PDConfig(
        1,
        SplitPolicy(
            min_uncached_tokens=64, min_decoding=0, prefix_from_decode=True, ttft_budget_s=1.0
        ),
    )
    first = make_request("a", 0.0, (1, 2), num_output=2)
    grown = make_request("b", 1.0, (1, 2, 3, 4, 5, 6, 7, 8), num_output=2)
    # "a" is short and stays on the decode replica; "b" shares its 32-token prefix.
    result = Cluster([profile] * 2, RoundRobinStandIn(), pd=pd).run([first, grown])
    assert result.pd["decisions"] == {**result.pd["decisions"], SHORT: 1, SPLIT: 1}
    assert result.pd["pulled_prefix_tokens"] == 32
    assert result.replicas[0].num_prefilled_tokens == 128 - 32
    assert result.pd["transferred_tokens"] == 128 - 32


def test_latency_histogram_percentiles_are_within_a_bin_of_exact():
    rng = random.Random(1)
    values = [rng.lognormvariate(-4, 1.0) for _ in range(5000)]
    histogram = LatencyHistogram()
    for value in values:
        histogram.add(value)
    ordered = sorted(values)
    for q in (50, 90, 99):
        exact = ordered[int(q / 100 * len(ordered)) - 1]
        assert histogram.percentile(q) == pytest.approx(exact, rel=0.01)
    span = LatencyHistogram()
    span.add_linear_span(0.01, 0.001, 3, weight=2)  # 10, 11, 12 ms, two sequences each
    assert span.total == 6 and span.percentile(100) == pytest.approx(0.012, rel=0.01)


def test_compare_pd_reports_the_bar_ratios_against_colocated(tmp_path):
    from once.sim.workload import load_mooncake

    requests = load_mooncake(_mooncake_file(tmp_path, num=60), minutes=None)
    profile = make_profile(block_size=512, kv_blocks=200, **LINKED)
    grid = PDGrid(num_prefill=(1,), thresholds=(512,), decode_budgets=(0, 256))
    report = compare_pd(requests, Scenario(profile, 3, 0.7), grid)
    assert len(report["sweep"]) == 2
    assert report["pick_default"]["setup"]["num_prefill"] == 1
    for key in ("pd_goodput_ratio_default", "pd_goodput_ratio_tight", "pd_p99_itl_ratio"):
        assert report[key] > 0
    assert report["colocated"]["itl_p99_s"] >= report["colocated"]["itl_p50_s"]
    # Chosen on the first half of the trace, reported on the second.
    choice, evaluation = report["choice_window"], report["evaluation_window"]
    assert choice["num_requests"] + evaluation["num_requests"] == len(requests)
    assert choice["num_sessions"] == 30 and evaluation["num_sessions"] == 30
    assert report["choice"]["colocated"] != report["colocated"]
    assert report["choice"]["pd_goodput_ratio_default"] > 0


def test_windows_split_sessions_whole_and_start_the_second_at_zero():
    first = [make_request(f"a{i}", float(i), (i,)) for i in range(4)]
    follow = [
        make_request("a0-2", 99.0, (0, 9), after="a0"),
        make_request("a3-2", 0.0, (3, 9), after="a3"),
    ]
    choice, evaluation = split_windows(first + follow)
    assert {r.request_id for r in choice} == {"a0", "a1", "a0-2"}  # follow-ups go along
    assert {r.request_id for r in evaluation} == {"a2", "a3", "a3-2"}
    assert sorted(r.arrival_s for r in evaluation if r.after is None) == [0.0, 1.0]
    with pytest.raises(ValueError, match="two sessions"):
        split_windows(first[:1])


def test_cli_pd_json_and_bad_splits(tmp_path, capsys):
    path = _mooncake_file(tmp_path, num=30)
    argv = ["--trace-path", str(path), "--replicas", "2", "--pd", "--pd-threshold", "512"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["num_prefill"] for row in report["sweep"]] == [1, 1]
    assert main([*argv, "--pd-prefill", "2"]) == 2
    assert "need 1 <= P < 2" in capsys.readouterr().err
