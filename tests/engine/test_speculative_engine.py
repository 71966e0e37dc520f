"""Speculative decoding in the engine: identical greedy output, exact KV rollback, forced
outputs, prefix caching, chunked budgets, metrics."""

import random

import pytest

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.speculative import Draft
from once.engine_http.metrics import EngineMetrics
from once.protocol.engine import GenerateRequest, SamplingParams


def make_engine(model_dir, **overrides):
    config = dict(model=str(model_dir), block_size=4, num_kv_blocks=256, seed=0)
    return LLMEngine(EngineConfig(**(config | overrides)))


def tokens_of(deltas):
    return [t for d in deltas for t in d.token_ids]


def greedy(rid, prompt, max_tokens=24, **extra):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(rid, tuple(prompt), params, **extra)


class OracleDrafter:
    """Drafts the known greedy continuation, corrupting one position in three drafts, so
    runs see full acceptance, partial acceptance and rejection at position 0."""

    def __init__(self, answers: dict[str, list[int]], prompts: dict[str, list[int]]):
        self.answers, self.prompts = answers, prompts
        self.rng = random.Random(0)
        self.seen: list[tuple[str, tuple[int, ...], list[int]]] = []

    def propose(self, requests, max_tokens):
        drafts = []
        for request, k in zip(requests, max_tokens, strict=True):
            done = len(request.all_token_ids) - len(self.prompts[request.request_id])
            draft = list(self.answers[request.request_id][done : done + k])
            if draft and self.rng.random() < 0.35:
                draft[self.rng.randrange(len(draft))] = 3  # a wrong id somewhere
            self.seen.append((request.request_id, tuple(request.all_token_ids), draft))
            drafts.append(Draft(draft))
        return drafts

    def on_finished(self, request):
        pass


PROMPTS = {f"r{i}": [5 + i, 17, 33 + 2 * i, 9, 200 - i, 41, 7 + i] for i in range(5)}


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    out = engine.generate([greedy(rid, p) for rid, p in PROMPTS.items()])
    return {rid: tokens_of(deltas) for rid, deltas in out.items()}


def check_block_accounting(engine):
    # After every step each running request holds exactly the blocks of its computed
    # tokens (rejected drafts rolled back), and the pool's count agrees.
    bs = engine.config.block_size
    held = set()
    for request in engine.scheduler.running:
        blocks = engine.kv.req_blocks[request.request_id]
        assert len(blocks) == -(-request.num_computed_tokens // bs), request.request_id
        held.update(b.block_id for b in blocks)
    assert engine.pool.num_used_blocks == len(held)


def run_checked(engine, requests):
    for request in requests:
        engine.add_request(request)
    results = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id].append(delta)
        check_block_accounting(engine)
    return {rid: tokens_of(d) for rid, d in results.items()}


def test_greedy_output_identical_with_accepts_and_rejections(tiny_model_dir, baseline):
    engine = make_engine(tiny_model_dir, num_speculative_tokens=5)
    engine.drafter = OracleDrafter(baseline, PROMPTS)
    got = run_checked(engine, [greedy(rid, p) for rid, p in PROMPTS.items()])
    assert got == baseline
    stats = engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["mean_acceptance_length"] == pytest.approx(
        1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    )
    per_position = stats["spec_accepted_tokens_per_position"]
    assert sum(per_position) == stats["num_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)
    assert stats["num_generated_tokens"] == 24 * len(PROMPTS)
    assert stats["tokens_per_decode_forward"] > 1.5
    assert engine.pool.num_used_blocks == 0


def test_rollback_leaves_no_block_behind_after_abort(tiny_model_dir, baseline):
    engine = make_engine(tiny_model_dir, num_speculative_tokens=7)
    engine.drafter = OracleDrafter(baseline, PROMPTS)
    for rid, prompt in PROMPTS.items():
        engine.add_request(greedy(rid, prompt))
    for _ in range(4):
        engine.step()
        check_block_accounting(engine)
    engine.abort_request("r0")
    engine.abort_request("r3")
    while engine.has_unfinished_requests():
        engine.step()
        check_block_accounting(engine)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.pool.blocks)
    assert not engine.kv.req_blocks


def test_tight_budget_trims_drafts_and_stays_identical(tiny_model_dir, baseline):
    # 6 tokens a step for 5 requests: drafts are cut to the budget, prefill is chunked.
    engine = make_engine(tiny_model_dir, num_speculative_tokens=8, max_num_batched_tokens=6)
    engine.drafter = OracleDrafter(baseline, PROMPTS)
    assert run_checked(engine, [greedy(rid, p) for rid, p in PROMPTS.items()]) == baseline
    assert engine.stats()["num_accepted_tokens"] > 0


def test_short_cache_drops_drafts_instead_of_preempting(tiny_model_dir, baseline):
    engine = make_engine(tiny_model_dir, num_kv_blocks=24, num_speculative_tokens=8)
    engine.drafter = OracleDrafter(baseline, PROMPTS)
    got = run_checked(engine, [greedy(rid, p) for rid, p in PROMPTS.items()])
    assert got == baseline


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_text_drafters_keep_greedy_output(tiny_model_dir, method):
    # A repetitive prompt makes the context drafters propose; the tiny model's greedy
    # output must not change.
    prompt = [11, 12, 13, 14, 15, 16] * 6
    plain = make_engine(tiny_model_dir).generate([greedy("a", prompt, 40)])
    engine = make_engine(tiny_model_dir, speculative_method=method)
    spec = engine.generate([greedy("a", prompt, 40)])
    assert tokens_of(spec["a"]) == tokens_of(plain["a"])
    assert engine.stats()["num_drafts"] > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_forced_copy_is_drafted_and_exact(tiny_model_dir, method):
    prompt = list(range(20, 80))
    forced = tuple(range(30, 70))  # the output copies a span of the prompt
    engine = make_engine(tiny_model_dir, speculative_method=method)
    request = GenerateRequest("f", tuple(prompt), forced_output_ids=forced)
    out = engine.generate([request])["f"]
    assert tokens_of(out) == list(forced)
    stats = engine.stats()
    assert stats["tokens_per_decode_forward"] > 4
    metrics = out[-1].metrics
    assert metrics.num_accepted_tokens == stats["num_accepted_tokens"] > 30
    assert metrics.num_drafts == stats["num_drafts"] > 0
    assert metrics.num_draft_tokens == stats["num_draft_tokens"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_never_see_the_forced_suffix(tiny_model_dir, method):
    check_drafts_ignore_the_forced_suffix(
        lambda: make_engine(tiny_model_dir, speculative_method=method)
    )


def check_drafts_ignore_the_forced_suffix(new_engine) -> None:
    """Replay a forced output, then the same output poisoned after `cut` ids: every draft
    proposed before the cut must be the same (drafters see committed ids only)."""
    prompt = [7, 8, 9, 10, 11] * 8
    clean = (7, 8, 9, 10, 11) * 4
    cut = 9
    poisoned = clean[:cut] + (99,) * (len(clean) - cut)
    proposals = []
    for forced in (clean, poisoned):
        engine = new_engine()
        seen: dict[tuple[int, ...], list[int]] = {}
        propose = engine.drafter.propose

        def spying(requests, max_tokens, propose=propose, seen=seen):
            drafts = propose(requests, max_tokens)
            for request, draft in zip(requests, drafts, strict=True):
                seen[tuple(request.all_token_ids)] = list(draft.token_ids)
            return drafts

        engine.drafter.propose = spying
        out = engine.generate([GenerateRequest("p", tuple(prompt), forced_output_ids=forced)])
        assert tokens_of(out["p"]) == list(forced)
        proposals.append(seen)
    before_cut = [c for c in proposals[0] if len(c) <= len(prompt) + cut]
    assert before_cut
    for context in before_cut:
        if context in proposals[1]:
            assert proposals[0][context] == proposals[1][context]
    # The first proposal after the prompt is the same whatever the forced ids ahead.
    first = min(proposals[0], key=len)
    assert proposals[1][first] == proposals[0][first]


def test_only_committed_blocks_enter_the_prefix_cache(tiny_model_dir, baseline):
    engine = make_engine(tiny_model_dir, num_speculative_tokens=6)
    engine.drafter = OracleDrafter(baseline, PROMPTS)
    prompt = PROMPTS["r1"]
    out = engine.generate([greedy("r1", prompt)])
    committed = prompt + tokens_of(out["r1"])
    assert committed[len(prompt) :] == baseline["r1"]
    cached = [b for b in engine.pool.blocks if b.block_hash is not None]
    assert cached
    bs = engine.config.block_size
    chunks = {tuple(committed[i : i + bs]) for i in range(0, len(committed) - bs + 1, bs)}
    assert all(b.token_ids in chunks for b in cached)
    # A follow-up request whose prompt is the whole conversation hits those blocks.
    engine.drafter = None
    again = engine.generate([greedy("again", committed, 2)])["again"]
    assert again[0].num_cached_tokens == len(cached) * bs


def test_stats_and_prometheus_carry_spec_counters(tiny_model_dir, baseline):
    engine = make_engine(tiny_model_dir, num_speculative_tokens=4)
    engine.drafter = OracleDrafter(baseline, PROMPTS)
    engine.generate([greedy("r2", PROMPTS["r2"])])
    stats = engine.stats()
    text = EngineMetrics().render(stats).decode()
    assert f"once_engine_draft_tokens_total {float(stats['num_draft_tokens'])}" in text
    assert f"once_engine_accepted_tokens_total {float(stats['num_accepted_tokens'])}" in text
    assert "once_engine_drafts_total" in text
    assert 'once_engine_spec_accepted_tokens_per_position_total{position="0"}' in text
    assert "once_engine_mean_acceptance_length" in text


def test_bad_speculative_config_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown speculative_method"):
        make_engine(tiny_model_dir, speculative_method="magic")
    with pytest.raises(ValueError, match="draft_model"):
        make_engine(tiny_model_dir, speculative_method="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=0)
