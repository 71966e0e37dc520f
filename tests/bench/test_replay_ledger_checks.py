"""The ledger's checks: each invariant broken on purpose, the engine's counts that keep
them through preemption, and the shared-cache bound that no stack may beat."""

from collections import Counter

from once.bench.replay.checks import ledger_invariants, shared_ideal
from once.bench.replay.ledger import (
    NEW_CONTENT,
    PREEMPTED,
    TIER_MISS,
    attribute_call,
    check_call,
    paid_twice,
)
from once.bench.replay.reference import reference_calls
from once.bench.replay.shared_ideal import shared_ideal_tokens
from once.engine.kv.blocks import BlockPool
from once.engine.kv.manager import KVCacheManager
from once.engine.request import Request
from once.engine.scheduler import Scheduler
from once.protocol.engine import GenerateRequest, SamplingParams


def _record(**overrides):
    record = {
        "stack": "once",
        "session_id": "s",
        "index": 1,
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "tier_cached_tokens": 0,
        "computed_tokens": 36,
        "recomputed_tokens": 0,
        "ideal_cached": 70,
        "previous_length": 70,
        "break_cause": None,
        "evictions_before": 0,
    }
    return record | overrides


def _causes(record, **kwargs):
    options = {"block_size": 16, "prefix_caching": True, "session_evictions": 0} | kwargs
    return attribute_call(record, **options)


def test_a_call_that_adds_up_keeps_every_invariant():
    record = _record(cached_tokens=48, computed_tokens=60, recomputed_tokens=8)
    causes = _causes(record)
    assert causes[PREEMPTED] == 8 and sum(causes.values()) == 60
    assert check_call(record, causes) == []


def test_cached_plus_computed_past_the_prompt_is_caught():
    # The preemption: a re-admission's hit on the request's own earlier work was
    # counted as cached, and the earlier work as computed, with no recompute named.
    record = _record(cached_tokens=80, computed_tokens=36)
    (broken,) = check_call(record, _causes(record))
    assert "prompt 100 != cached 80 + computed 36 - recomputed 0" in broken


def test_a_part_larger_than_its_whole_is_caught():
    record = _record(tier_cached_tokens=65)
    assert any("exceeds its whole" in v for v in check_call(record, _causes(record)))
    record = _record(computed_tokens=36, recomputed_tokens=40, cached_tokens=104)
    assert any("exceeds its whole" in v for v in check_call(record, _causes(record)))


def test_causes_that_do_not_sum_to_computed_are_caught():
    record = _record()
    causes = _causes(record)
    assert check_call(record, causes) == []
    short = causes - Counter({NEW_CONTENT: 1})
    assert any("its causes are" in v for v in check_call(record, short))
    negative = causes + Counter()
    negative[NEW_CONTENT] = -1
    assert any("its causes are" in v for v in check_call(record, negative))


def test_a_tiered_stack_names_its_misses_tier_misses_and_they_count_as_paid_twice():
    record = _record(cached_tokens=16, computed_tokens=84)
    causes = _causes(record, session_evictions=2, tiers=True)
    assert causes[TIER_MISS] == 48
    assert paid_twice(causes) == 48
    assert check_call(record, causes) == []


def test_ledger_invariants_report_every_stack_and_call():
    good = _record(index=0, ideal_cached=0, cached_tokens=0, computed_tokens=100)
    bad = _record(cached_tokens=80)
    records = {"once": {"s": [good, bad]}, "naive": {"s": [good]}}
    checked = ledger_invariants(records, {"once": True, "naive": False}, {}, 16)
    assert checked["calls_checked"] == 3 and checked["num_violations"] == 1
    assert not checked["holds"] and "once: s call 1" in checked["violations"][0]


# -- the engine's counts -----------------------------------------------------------------


def _scheduler(caching: bool, budget: int = 4):
    pool = BlockPool(16, 4, enable_caching=caching)
    return Scheduler(KVCacheManager(pool), max_num_seqs=4, max_num_batched_tokens=budget)


def _request(prompt):
    params = SamplingParams(temperature=0, max_tokens=4)
    return Request(GenerateRequest("a", tuple(prompt), params), eos_token_ids=(), max_len=64)


def _step(scheduler, request):
    out = scheduler.schedule()
    samples = [s.request for s in out.scheduled if s.samples]
    return scheduler.update_from_output(out, samples, [[7] for _ in samples])


def _preempted_mid_prefill(caching: bool) -> Request:
    scheduler, request = _scheduler(caching), _request(list(range(10, 20)))
    scheduler.add(request)
    _step(scheduler, request)  # the first 4 prompt tokens
    scheduler.running.remove(request)
    scheduler._preempt(request)
    while not request.output_token_ids:
        _step(scheduler, request)
    return request


def test_a_recompute_after_preemption_is_counted_and_the_prompt_adds_up():
    metrics = _preempted_mid_prefill(caching=False).metrics
    assert (metrics.num_cached_tokens, metrics.num_computed_tokens) == (0, 14)
    assert metrics.num_recomputed_tokens == 4
    assert metrics.num_prompt_tokens == (
        metrics.num_cached_tokens + metrics.num_computed_tokens - metrics.num_recomputed_tokens
    )


def test_a_hit_on_its_own_earlier_work_is_neither_cached_nor_recomputed():
    # Its first block survived the preemption in the prefix cache: nothing is paid twice,
    # and the hit is not a cache saving (it was this request's own prefill).
    metrics = _preempted_mid_prefill(caching=True).metrics
    assert (metrics.num_cached_tokens, metrics.num_computed_tokens) == (0, 10)
    assert metrics.num_recomputed_tokens == 0


# -- the shared-cache bound ----------------------------------------------------------------


def test_the_shared_bound_counts_each_prompt_prefix_once_and_outputs_free():
    # Session 1 continues its own output; session 2 repeats session 1's first prompt.
    one = [([1, 2, 3], [9]), ([1, 2, 3, 9, 4, 5], [8])]
    two = [([1, 2, 3, 6], [5])]
    bound = shared_ideal_tokens({"a": one, "b": two})
    # In all: 1 2 3 once, 9 free (an output), 4 5, and 6. Per folder, 1 2 3 is in both
    # folders' prompts, so either may have paid for it: neither folder's bound counts it.
    assert bound == {"a": 2, "b": 1, "total": 6}
    # The per-session reference of session 2 counts all 4 of its tokens as new: a shared
    # cache beats it, and this bound is below it.
    (call,) = reference_calls([[1, 2, 3, 6]], [[5]])
    assert call.num_ideal_new == 4 > bound["b"]


class _Plan:
    def __init__(self, session_id, calls):
        self.session_id = session_id
        self.calls = [_Call(p, o) for p, o in calls]


class _Call:
    def __init__(self, prompt_ids, forced_ids):
        self.prompt_ids, self.forced_ids = prompt_ids, forced_ids


def test_a_stack_under_the_shared_bound_is_reported():
    plans = [("a", _Plan("s1", [([1, 2, 3], [9]), ([1, 2, 3, 9, 4], [8])]))]
    honest = {"once": {"s1": [{"computed_tokens": 3}, {"computed_tokens": 1}]}}
    assert shared_ideal(plans, honest)["holds"]
    impossible = {"once": {"s1": [{"computed_tokens": 2}, {"computed_tokens": 1}]}}
    checked = shared_ideal(plans, impossible)
    assert not checked["holds"] and "under the bound 4" in checked["beaten"][0]


def test_a_disaggregated_stack_is_held_to_the_bound_with_its_prefill_engines_work():
    from once.bench.replay.checks import check_disaggregated_bound

    plans = [("a", _Plan("s1", [([1, 2, 3], [9]), ([1, 2, 3, 9, 4], [8])]))]
    # The decode engine computed 1 token a call: the prefill engine did the rest.
    records = {"once/pd": {"s1": [{"computed_tokens": 1}, {"computed_tokens": 1}]}}
    bound = shared_ideal(plans, records, prefill_elsewhere=("once/pd",))
    assert bound["holds"] and "once/pd" not in bound["computed"]
    check_disaggregated_bound(bound, {"once/pd": (2, 2)})
    assert bound["holds"] and bound["computed"]["once/pd"]["total"] == 4
    check_disaggregated_bound(bound, {"once/pd": (2, 1)})  # a prefill count lost
    assert not bound["holds"] and "with its prefill engines" in bound["beaten"][-1]
