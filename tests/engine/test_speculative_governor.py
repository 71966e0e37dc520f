"""The cost-aware draft length: the k that maximizes committed tokens per step second."""

import pytest

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.speculative.governor import DraftLengthGovernor
from once.protocol.engine import GenerateRequest


def _trained(accept_first: int, *, base_s: float, row_s: float) -> DraftLengthGovernor:
    """A governor that saw 4-id drafts with the first `accept_first` ids always accepted,
    and steps costing base_s + row_s per row."""
    governor = DraftLengthGovernor(4, explore_every=10**9)
    for _ in range(200):
        governor.observe_verification(4, accept_first)
    for rows in (1, 2, 4, 8, 16, 32):
        governor.observe_step(rows, base_s + row_s * rows)
    return governor


def test_cheap_rows_and_good_drafts_draft_everything():
    # Memory-bound (a GPU at batch 1): rows almost free, every draft accepted.
    assert _trained(4, base_s=0.030, row_s=0.0001).draft_length(1) == 4


def test_drafts_stop_where_acceptance_stops_paying():
    # Two ids always accepted, the rest never: a third and fourth row only cost.
    assert _trained(2, base_s=0.030, row_s=0.004).draft_length(1) == 2


def test_compute_bound_batches_do_not_speculate_on_poor_drafts():
    # Each row costs as much as the fixed part over 8 rows; half the first ids accepted.
    governor = DraftLengthGovernor(4, explore_every=10**9)
    for i in range(200):
        governor.observe_verification(4, i % 2)
    for rows in (8, 16, 24, 40):
        governor.observe_step(rows, 0.010 + 0.010 * rows)
    assert governor.draft_length(8) == 0


def test_without_cost_data_and_when_exploring_it_drafts_the_maximum():
    governor = DraftLengthGovernor(4, explore_every=3)
    assert governor.draft_length(8) == 4  # nothing measured yet
    for _ in range(200):
        governor.observe_verification(4, 0)
    for rows in (8, 16, 24):
        governor.observe_step(rows, 0.010 + 0.010 * rows)
    choices = [governor.draft_length(8) for _ in range(6)]
    assert choices.count(4) == 2 and choices.count(0) == 4  # every third step explores


def test_prior_and_estimates():
    governor = DraftLengthGovernor(3)
    assert governor.acceptance_chain() == [0.5, 0.5, 0.5]
    assert governor.step_cost() is None
    governor.observe_step(2, 0.012)
    governor.observe_step(6, 0.020)
    assert governor.step_cost() == pytest.approx((0.008, 0.002))


def test_engine_output_is_unchanged_by_the_governor(tiny_model_dir):
    prompt = tuple(range(20, 80))
    forced = tuple(range(30, 70))  # copies the prompt: drafts are accepted
    outputs = {}
    for adaptive in (False, True):
        config = EngineConfig(
            model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256,
            speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=adaptive,
        )  # fmt: skip
        engine = LLMEngine(config)
        result = engine.generate([GenerateRequest("r", prompt, forced_output_ids=forced)])
        outputs[adaptive] = [t for d in result["r"] for t in d.token_ids]
        if adaptive:
            assert engine.governor is not None and engine.stats()["num_drafts"] > 0
    assert outputs[True] == outputs[False] == list(forced)
