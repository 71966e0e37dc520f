"""`once bench spec` on the tiny random model: the group-major passes add up, and the
figures the bars read come from the right passes."""

import argparse

import pytest

from once.bench.replay.stacks import make_tiny_replay_model
from once.bench.spec_bench.cli import run_benchmark


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    folder = make_tiny_replay_model(tmp_path_factory.mktemp("tiny") / "m", 1024)
    args = argparse.Namespace(
        model=str(folder),
        num_calls=5,
        prompt_tokens=160,
        output_tokens=12,
        batch=2,
        methods=["ngram", "suffix"],
        num_speculative_tokens=4,
        adaptive=True,  # the governor's path; the fixed length is the engine tests'
        max_num_batched_tokens=256,
        kv_cache_gib=0.05,
        num_threads=1,
    )
    return run_benchmark(args, lambda message: None)


def test_every_variant_decodes_every_forced_token(result):
    forced = [p for p in result["passes"] if p["forced"]]
    assert {(p["batch"], p["method"]) for p in forced} == {
        (1, "none"), (1, "ngram"), (1, "suffix"), (2, "none"), (2, "ngram"), (2, "suffix"),
    }  # fmt: skip
    # All groups are summed: every pass's decode steps committed the same forced ids, 12 per
    # call less the first, which the prompt's last prefill step samples.
    assert {p["num_decode_tokens"] for p in forced} == {5 * (12 - 1)}


def test_bar_figures_come_from_the_best_drafter(result):
    by = {(p["batch"], p["method"], p["forced"]): p for p in result["passes"]}
    best = result["best_method"]
    assert best == max(("ngram", "suffix"), key=lambda m: by[(1, m, True)]["tokens_per_forward"])
    assert result["mean_acceptance_length"] == by[(1, best, True)]["tokens_per_forward"]
    assert result["speedup_b1"] == pytest.approx(
        by[(1, best, True)]["decode_tok_s"] / by[(1, "none", True)]["decode_tok_s"]
    )
    assert result["speedup_b1_by_method"][best] == result["speedup_b1"]
    assert result["speedup_b8_by_method"][best] == result["speedup_b8"]
    # Without speculation every decode forward commits exactly one token.
    assert by[(1, "none", True)]["tokens_per_forward"] == 1.0
    assert by[(1, best, True)]["num_drafts"] > 0


def test_free_greedy_is_identical_with_every_drafter(result):
    assert result["identical"] is True
    assert result["mismatched_calls"] == []
