"""The ideal reference and the ledger's attribution, on small hand-made sessions."""

import pytest

from once.bench.replay.ledger import (
    BLOCK_BOUNDARY,
    EVICTED,
    FIRST_CALL,
    NEW_CONTENT,
    NO_PREFIX_CACHE,
    UNATTRIBUTED,
    attribute_call,
)
from once.bench.replay.reference import ideal_ratio, reference_calls


def test_append_only_session_reuses_request_plus_output():
    prompts = [[1, 2, 3], [1, 2, 3, 9, 4, 5], [1, 2, 3, 9, 4, 5, 8, 6]]
    outputs = [[9], [8], [7]]
    calls = reference_calls(prompts, outputs)
    assert [c.num_ideal_cached for c in calls] == [0, 4, 7]
    assert [c.num_ideal_new for c in calls] == [3, 2, 1]
    assert ideal_ratio(calls) == pytest.approx(6 / 17)


def test_any_earlier_request_counts_not_only_the_previous():
    # Call 2 returns to call 0's conversation (a CodeR role switch back).
    prompts = [[1, 2, 3, 4], [7, 7, 7], [1, 2, 3, 4, 5, 6]]
    outputs = [[5], [8], [9]]
    calls = reference_calls(prompts, outputs, previous_in_chain=[None, None, 0])
    assert [c.num_ideal_cached for c in calls] == [0, 0, 5]
    assert calls[2].num_previous_shared == 5 and calls[2].previous_length == 5


def test_edited_history_only_reuses_up_to_the_edit():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 0, 4, 5, 6, 7]]
    calls = reference_calls(prompts, [[6], [1]])
    assert calls[1].num_ideal_cached == 2
    assert calls[1].num_ideal_new == 5


def test_identical_request_is_fully_cacheable():
    calls = reference_calls([[4, 5, 6], [4, 5, 6]], [[1], [1]])
    assert calls[1].num_ideal_new == 0


@pytest.mark.parametrize(
    "prompts, outputs, chain",
    [
        ([[1]], [[2], [3]], None),  # lengths differ
        ([[]], [[1]], None),  # empty prompt
        ([[1], [2]], [[1], [2]], [None, 1]),  # continues itself
    ],
)
def test_bad_inputs_are_refused(prompts, outputs, chain):
    with pytest.raises(ValueError):
        reference_calls(prompts, outputs, chain)


def _record(**overrides):
    record = {
        "index": 1,
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "computed_tokens": 36,
        "ideal_cached": 70,
        "previous_length": 70,
        "break_cause": None,
    }
    return record | overrides


def test_attribution_sums_to_computed_and_names_block_boundary():
    causes = attribute_call(_record(), block_size=16, prefix_caching=True, session_evictions=0)
    assert causes == {NEW_CONTENT: 30, BLOCK_BOUNDARY: 6}
    assert sum(causes.values()) == 36


def test_first_call_and_no_prefix_cache():
    first = attribute_call(
        _record(index=0, ideal_cached=0, cached_tokens=0, computed_tokens=100),
        block_size=16,
        prefix_caching=False,
        session_evictions=0,
    )
    assert first == {FIRST_CALL: 100}
    naive = attribute_call(
        _record(cached_tokens=0, computed_tokens=100),
        block_size=16,
        prefix_caching=False,
        session_evictions=0,
    )
    assert naive == {NEW_CONTENT: 30, NO_PREFIX_CACHE: 70}


def test_a_miss_is_evicted_only_when_the_engine_evicted():
    record = _record(cached_tokens=16, computed_tokens=84)
    evicted = attribute_call(record, block_size=16, prefix_caching=True, session_evictions=3)
    unexplained = attribute_call(record, block_size=16, prefix_caching=True, session_evictions=0)
    assert evicted[EVICTED] == 48 and UNATTRIBUTED not in evicted
    assert unexplained[UNATTRIBUTED] == 48


def test_prefix_changed_takes_the_changed_part_of_the_new_tokens():
    record = _record(ideal_cached=20, cached_tokens=16, computed_tokens=84, break_cause="x")
    causes = attribute_call(record, block_size=16, prefix_caching=True, session_evictions=0)
    assert causes == {"prefix_changed:x": 50, NEW_CONTENT: 30, BLOCK_BOUNDARY: 4}
