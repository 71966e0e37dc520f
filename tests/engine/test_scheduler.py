"""Scheduler.update_from_output on CPU, no model: what a forward's results do to requests,
with exact block ids and free order."""

from once.engine.kv.blocks import BlockPool
from once.engine.kv.manager import KVCacheManager
from once.engine.request import Request, RequestStatus
from once.engine.scheduler import Scheduler
from once.protocol.engine import GenerateRequest, SamplingParams

BLOCK_SIZE = 4
PROMPT = [21, 22, 23, 24, 25, 26]  # 6 tokens: blocks of 4 + 2


def make_scheduler(num_blocks=8, budget=64):
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_caching=False)
    return Scheduler(KVCacheManager(pool), max_num_seqs=8, max_num_batched_tokens=budget), pool


def make_request(rid="a", prompt=PROMPT, stop=()):
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=tuple(stop))
    return Request(GenerateRequest(rid, tuple(prompt), params), eos_token_ids=(), max_len=512)


def run_step(scheduler, committed_by_id):
    out = scheduler.schedule()
    sampled = [s.request for s in out.scheduled if s.request.request_id in committed_by_id]
    committed = [committed_by_id[r.request_id] for r in sampled]
    return scheduler.update_from_output(out, sampled, committed)


def test_a_prefill_commits_its_first_token_and_counts_its_prompt():
    scheduler, pool = make_scheduler()
    request = make_request()
    scheduler.add(request)
    update = run_step(scheduler, {"a": [10]})
    assert request.num_computed_tokens == 6 and request.output_token_ids == [10]
    assert request.metrics.num_computed_tokens == 6
    assert update.num_computed_prompt_tokens == 6 and update.num_recomputed_tokens == 0
    assert [(o.request, o.new_token_ids, o.finish_reason) for o in update.outputs] == [
        (request, [10], None)
    ]
    assert update.num_generated_tokens == 1
    assert update.num_tokens_per_decode == [] and update.verifications == []
    assert scheduler.kv.block_ids("a") == [0, 1]


def test_a_chunk_that_does_not_reach_the_prompt_end_commits_nothing():
    scheduler, _ = make_scheduler(budget=4)
    request = make_request()
    scheduler.add(request)
    update = run_step(scheduler, {})  # the runner samples nothing for a partial prefill
    assert request.num_computed_tokens == 4 and request.output_token_ids == []
    assert update.num_computed_prompt_tokens == 4 and update.outputs == []
    update = run_step(scheduler, {"a": [10]})
    assert update.num_computed_prompt_tokens == 2 and request.metrics.num_computed_tokens == 6


def test_a_verification_keeps_kv_up_to_its_last_accepted_draft_and_rolls_back_the_rest():
    scheduler, pool = make_scheduler()
    request = make_request()
    scheduler.add(request)
    run_step(scheduler, {"a": [10]})
    request.draft_token_ids = [11, 12, 13, 14]
    update = run_step(scheduler, {"a": [11, 99]})  # draft 11 accepted, 99 corrects 12
    # 6 prompt + [10, 11, 99]: the K/V of all but the newest id (computed next step).
    assert request.output_token_ids == [10, 11, 99] and request.num_computed_tokens == 8
    assert request.draft_token_ids == []
    assert update.verifications == [(4, 1)] and update.num_tokens_per_decode == [2]
    assert update.num_computed_prompt_tokens == 0
    # The step held blocks 0-2 for positions 0..10; block 2 held only drafts' K/V.
    assert scheduler.kv.block_ids("a") == [0, 1]
    assert list(pool.free_queue)[-1] == 2
    m = request.metrics
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (1, 4, 1)


def test_a_stop_id_ends_the_commit_and_finishes_the_request_blocks_tail_first():
    scheduler, pool = make_scheduler()
    request = make_request(stop=[7])
    scheduler.add(request)
    run_step(scheduler, {"a": [10]})
    request.draft_token_ids = [11, 7, 13]
    update = run_step(scheduler, {"a": [11, 7, 13, 50]})  # all accepted, then the bonus
    assert [(o.new_token_ids, o.finish_reason) for o in update.outputs] == [([11, 7], "stop")]
    assert request.output_token_ids == [10, 11, 7]
    assert request.status == RequestStatus.FINISHED and request.finish_reason == "stop"
    assert scheduler.running == [] and not scheduler.has_unfinished()
    # The rolled-back draft block first, then the request's own, tail first.
    assert list(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_finish_takes_a_waiting_request_out_of_the_queue():
    scheduler, pool = make_scheduler()
    request = make_request()
    scheduler.add(request)
    scheduler.finish(request, "abort")
    assert not scheduler.has_unfinished() and request.finish_reason == "abort"
    assert request.is_finished and pool.num_free_blocks == 8
