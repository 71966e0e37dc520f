"""`once replay --kv-blocks`: once on a device pool too small for two sessions side by
side, without and with KV tiers, in one run of hand-made sessions."""

import asyncio

import pytest

from once.bench.replay import cli
from once.bench.replay.kv_pressure import HINTS, PRESSURE, TIERS
from tests.bench.test_replay_report import _args, _session


@pytest.fixture(scope="module")
def pressure_report():
    sessions = [("folder-a", _session("a")), ("folder-b", _session("b"))]
    # A session reaches 752 tokens (47 blocks of 16): 48 blocks hold one, not two; the
    # context is what the pool holds (an engine refuses a pool under one request).
    args = _args(concurrency=2, kv_blocks=48, kv_host_blocks=None, kv_disk_gib=0.1,
                 max_model_len=768, kv_offload="write_through", kv_hints=True,
                 pacing="recorded",
                 time_scale=0.005)  # fmt: skip
    return asyncio.run(cli.run_replay(sessions, args))


def test_eviction_costs_recompute_and_the_tiers_bring_it_back(pressure_report):
    section = pressure_report["kv_pressure"]
    variants = section["variants"]
    assert variants["once"]["evicted_tokens"] == 0
    assert variants[PRESSURE]["evicted_tokens"] > 0 and variants[PRESSURE]["num_kv_evictions"]
    assert variants[TIERS]["kv_tier_host_hit_blocks"] > 0
    assert section["evicted_ratio_tiers_vs_none"] <= 0.2
    assert section["outputs_identical"]
    # The tiers' reload is counted as cached: the once stack's prompt work, nearly.
    assert variants[TIERS]["computed_tokens"] < variants[PRESSURE]["computed_tokens"]


def test_bad_pressure_flags_are_refused():
    assert cli.main(["--kv-blocks", "0"]) == 2
    assert cli.main(["--kv-blocks", "8", "--replicas", "2"]) == 2
    assert cli.main(["--kv-blocks", "8", "--kv-hints"]) == 2  # hints need recorded pauses


def test_what_the_tiers_served_counts_as_cached_not_as_never_computed(pressure_report):
    # A call's cached tokens are what a hit brought that it never had (a preempted
    # prefill that reloads its own earlier work from a tier gets no credit for it); what
    # it computed covers the rest, and what it computed twice is counted as such.
    for rows in pressure_report["calls"][TIERS].values():
        for row in rows:
            assert row["computed_tokens"] - row["recomputed_tokens"] == (
                row["prompt_tokens"] - row["cached_tokens"]
            )
            assert 0 <= row["tier_cached_tokens"] <= row["cached_tokens"]
    assert pressure_report["ledger_invariants"]["holds"]
    assert pressure_report["shared_ideal"]["holds"]


def test_the_recompute_ratio_counts_every_cause_and_the_pool_is_named(pressure_report):
    section = pressure_report["kv_pressure"]
    for figures in section["variants"].values():
        causes = figures["miss_causes"]
        assert figures["recomputed_tokens"] >= figures["evicted_tokens"]
        assert figures["preempted_tokens"] == causes.get("preempted", 0)
        assert figures["unattributed_tokens"] == 0
    assert section["recompute_ratio_tiers_vs_none"] is not None
    assert section["kv_pool_tokens"] == 48 * 16 and section["context_cap"] == 768


def test_the_hinted_variant_sends_a_hint_after_every_call_and_the_engine_keeps_blocks(
    pressure_report,
):
    section = pressure_report["kv_pressure"]
    hinted = section["variants"][HINTS]
    # Text-action sessions (mini-swe-agent): every reply after the first carries the
    # running estimate, so calls 1-3 of each of the 2 sessions end in a hint.
    assert hinted["kv_pause_hints"] == 6 and hinted["kv_pause_unknown_sessions"] == 0
    assert hinted["kv_pause_kept_blocks"] > 0
    assert section["variants"][TIERS].get("kv_pause_hints", 0) == 0
    assert section["after_pause_ttft_p90_ratio_hints_vs_none"] is not None
    assert section["after_pause_computed_ratio_hints_vs_none"] is not None
    assert 0 < hinted["computed_tokens_after_pause"] <= hinted["computed_tokens"]
    assert section["outputs_identical"]
