"""`once bench spec` on the tiny random model: the group-major passes add up, and the
figures the bars read come from the right passes."""

import argparse

import pytest

from once.bench.replay.stacks import make_tiny_replay_model
from once.bench.spec_bench.ceiling import oracle_forwards
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


@pytest.mark.parametrize("k", [1, 3, 8])
def test_copy_oracle_counts_forwards_like_the_engine(k):
    # Every output id occurs in the prompt, in order: each forward commits k drafts + 1.
    assert oracle_forwards([7, 1, 2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 5, 6], k) == -(-6 // (k + 1))
    # Ids seen nowhere before: one forward each, whatever k.
    assert oracle_forwards([7, 8], [1, 2, 3, 4], k) == 4
    # The output copies itself once committed: 5, 6, then "5 6" + bonus 5, then the last.
    assert oracle_forwards([9], [5, 6, 5, 6, 5, 6], 8) == 4


def test_no_drafter_beats_the_copy_oracle(result):
    # The fixture drafts up to 4 ids from the context: the oracle at k=4 bounds both.
    by = {(p["batch"], p["method"], p["forced"]): p for p in result["passes"]}
    for method in ("ngram", "suffix"):
        assert by[(1, method, True)]["tokens_per_forward"] <= result["copy_ceiling"]["4"]
    ceiling = list(result["copy_ceiling"].values())
    assert ceiling == sorted(ceiling) and ceiling[0] >= 1.0
