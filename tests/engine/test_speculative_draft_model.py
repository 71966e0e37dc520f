"""The draft-model drafter: output unchanged by any draft model, exact block accounting,
lazy KV sync after rejections, sampled drafts that keep rejection sampling lossless."""

import shutil
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.loader import load_model_weights
from once.engine.models.llama import LlamaModel
from once.engine.request import Request
from once.engine.speculative.draft_model import DraftModelDrafter
from once.engine.speculative.verify import sampling_probs
from once.engine.testing import make_tiny_model, reference_model
from once.protocol.engine import GenerateRequest, SamplingParams
from tests.engine.test_speculative_engine import (
    check_block_accounting as check_target_block_accounting,
)
from tests.engine.test_speculative_engine import check_drafts_ignore_the_forced_suffix

K = 4
MAX_TOKENS = 1 + 5 * (K + 1)  # the first token, then 5 verifications of K full drafts
PROMPTS = {f"r{i}": [5 + i, 17, 33 + 2 * i, 9, 200 - i, 41, 7 + i] for i in range(4)}


def make_engine(model_dir, **overrides):
    config = dict(model=str(model_dir), block_size=4, num_kv_blocks=256, seed=0)
    return LLMEngine(EngineConfig(**(config | overrides)))


def draft_engine(model_dir, draft_dir, **overrides):
    return make_engine(
        model_dir,
        speculative_method="draft",
        draft_model=str(draft_dir),
        num_speculative_tokens=K,
        **overrides,
    )


def tokens_of(deltas):
    return [t for d in deltas for t in d.token_ids]


def greedy(rid, prompt, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(rid, tuple(prompt), params)


def perturbed_copy(source, folder, scale: float):
    """The source model's weights plus noise: a draft that agrees with it often, not always."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    shutil.copy(source / "config.json", folder)
    generator = torch.Generator().manual_seed(7)
    state = load_file(source / "model.safetensors")
    noisy = {n: t + scale * torch.randn(t.shape, generator=generator) for n, t in state.items()}
    save_file(noisy, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models and thousands of tiny per-request ops: on a small shared machine torch's
    # thread pool costs up to ~20x more than it gives. Restored after: it is process-wide.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "other_seed": make_tiny_model(root / "other_seed", seed=1),
        "perturbed": perturbed_copy(tiny_model_dir, root / "perturbed", 0.03),
    }


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    out = make_engine(tiny_model_dir).generate([greedy(r, p) for r, p in PROMPTS.items()])
    return {rid: tokens_of(deltas) for rid, deltas in out.items()}


def check_block_accounting(engine):
    # Target: as with every drafter. Draft pool: the states' blocks and the free list
    # partition it.
    check_target_block_accounting(engine)
    bs = engine.config.block_size
    drafter = engine.drafter
    draft_held = [b for s in drafter.states.values() for b in s.block_ids]
    assert sorted(draft_held + drafter.free_blocks) == list(range(drafter.kv_cache.num_blocks))
    for state in drafter.states.values():
        assert len(state.block_ids) >= -(-len(state.token_ids) // bs)


def load_drafter(model_dir, num_blocks=64, target_vocab_size=256) -> DraftModelDrafter:
    config, weights, _ = load_model_weights(model_dir)
    model = LlamaModel(config, weights, 512)
    return DraftModelDrafter(model, target_vocab_size, num_blocks, block_size=4, max_len=512)


def request(rid, tokens, **sampling):
    params = SamplingParams(**({"temperature": 0, "max_tokens": 64} | sampling))
    return Request(GenerateRequest(rid, tuple(tokens), params), (2,), 10_000)


def test_same_model_drafts_are_always_accepted(tiny_model_dir, baseline):
    engine = draft_engine(tiny_model_dir, tiny_model_dir)
    out = engine.generate([greedy(r, p) for r, p in PROMPTS.items()])
    assert {rid: tokens_of(d) for rid, d in out.items()} == baseline
    stats = engine.stats()
    assert stats["num_drafts"] == 5 * len(PROMPTS)
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] == 5 * K * len(PROMPTS)
    assert stats["mean_acceptance_length"] == 1 + K


@pytest.mark.parametrize("kind", ["other_seed", "perturbed"])
def test_other_draft_keeps_greedy_output_and_frees_every_block(
    tiny_model_dir, drafts, baseline, kind
):
    engine = draft_engine(tiny_model_dir, drafts[kind])
    for rid, prompt in PROMPTS.items():
        engine.add_request(greedy(rid, prompt))
    got = {rid: [] for rid in PROMPTS}
    num_steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got[delta.request_id].extend(delta.token_ids)
        check_block_accounting(engine)
        num_steps += 1
        if num_steps == 4:
            assert "r0" in engine.drafter.states
            engine.abort_request("r0")
            assert "r0" not in engine.drafter.states
    assert got["r0"] == baseline["r0"][: len(got["r0"])]
    assert {rid: got[rid] for rid in ("r1", "r2", "r3")} == {
        rid: baseline[rid] for rid in ("r1", "r2", "r3")
    }
    stats = engine.stats()
    assert stats["num_drafts"] > 0
    if kind == "perturbed":  # full, partial and failed drafts all happened
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
        assert stats["spec_accepted_tokens_per_position"][K - 1] > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.kv.req_blocks
    assert not engine.drafter.states
    assert len(engine.drafter.free_blocks) == engine.drafter.kv_cache.num_blocks


def test_sampled_drafts_are_reproducible_per_seed(tiny_model_dir, drafts):
    def run(seeds):
        engine = draft_engine(tiny_model_dir, drafts["perturbed"])
        requests = [
            GenerateRequest(
                f"s{i}",
                tuple(PROMPTS["r1"]),
                SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=seed),
            )
            for i, seed in enumerate(seeds)
        ]
        out = engine.generate(requests)
        assert engine.stats()["num_accepted_tokens"] > 0
        return [tokens_of(out[r.request_id]) for r in requests]

    first = run([1, 2, 3])
    assert run([1, 2, 3]) == first
    assert run([3, 1, 2]) == [first[2], first[0], first[1]]  # independent of batch order
    assert len({tuple(t) for t in first}) == 3


def test_sampled_drafts_carry_the_distribution_they_came_from(tiny_model_dir, drafts):
    drafter = load_drafter(drafts["perturbed"])
    params = dict(temperature=0.7, top_k=20, seed=5)
    r = request("a", PROMPTS["r2"], **params)
    draft = drafter.propose([r], [K])[0]
    assert len(draft.token_ids) == K and draft.probs.shape == (K, 256)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(K))
    assert ((draft.probs > 0).sum(-1) <= 20).all()  # top-k applied
    for i, token in enumerate(draft.token_ids):
        assert draft.probs[i, token] > 0
    # Row 0 is the draft model's processed distribution after the committed context.
    reference = reference_model(drafts["perturbed"])
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPTS["r2"]])).logits[0, -1:]
    expected = sampling_probs(logits, SamplingParams(**params))[0]
    assert torch.allclose(draft.probs[0], expected, atol=1e-5)
    assert drafter.propose([request("g", PROMPTS["r2"])], [K])[0].probs is None  # greedy


def test_sampled_output_follows_the_target_distribution(tiny_model_dir, tiny_reference, drafts):
    # With max_tokens 3, output token 1 always comes from verifying one sampled draft.
    # Its marginal must be exactly the target's: sum over t0 of p(t0) p(t1 | t0). The
    # acceptance rate must be the draft-model value E[sum_x min(p(x), q(x))], which
    # holds only if the returned probs are the ones the drafts were sampled from.
    num_samples = 2000
    prompt = PROMPTS["r3"]
    params = SamplingParams(temperature=1.0, top_k=40, max_tokens=3, ignore_eos=True)
    engine = draft_engine(
        tiny_model_dir,
        drafts["perturbed"],
        num_kv_blocks=4096,  # room for every draft: none is dropped for want of blocks
        max_num_seqs=512,
        max_num_batched_tokens=4096,
    )
    requests = [
        GenerateRequest(f"s{i}", tuple(prompt), replace(params, seed=i)) for i in range(num_samples)
    ]
    out = engine.generate(requests)
    second = [tokens_of(out[r.request_id])[1] for r in requests]

    draft_reference = reference_model(drafts["perturbed"])
    contexts = torch.tensor([prompt + [t] for t in range(256)])
    with torch.no_grad():
        p0 = sampling_probs(tiny_reference(torch.tensor([prompt])).logits[0, -1:], params)[0]
        p1 = sampling_probs(tiny_reference(contexts).logits[:, -1], params)  # (256, vocab)
        q1 = sampling_probs(draft_reference(contexts).logits[:, -1], params)
    marginal = p0 @ p1
    top = marginal.argsort(descending=True)[:8].tolist()
    counts = [second.count(t) for t in top] + [num_samples - sum(t in top for t in second)]
    expected = [num_samples * float(marginal[t]) for t in top]
    expected.append(num_samples - sum(expected))
    assert chisquare(counts, expected).pvalue > 1e-3

    stats = engine.stats()
    assert stats["num_draft_tokens"] == num_samples
    accept = float(p0 @ torch.minimum(p1, q1).sum(-1))
    rate = stats["num_accepted_tokens"] / num_samples
    assert abs(rate - accept) < 4 * (accept * (1 - accept) / num_samples) ** 0.5


def test_sync_rolls_back_to_the_committed_prefix_and_runs_only_unseen_ids(tiny_model_dir):
    drafter = load_drafter(tiny_model_dir)
    fed: list[list[int]] = []
    forward = drafter.model.forward

    def spying(input_ids, *args):
        fed.append(input_ids.tolist())
        return forward(input_ids, *args)

    drafter.model.forward = spying
    r = request("a", PROMPTS["r0"] + [60, 61, 62])
    context = list(r.all_token_ids)
    d = drafter.propose([r], [K])[0].token_ids
    assert len(d) == K
    assert fed == [context, d[:1], d[1:2], d[2:3]]  # the last draft is never run
    state = drafter.states["a"]
    assert state.token_ids == context + d[:3]
    assert len(state.block_ids) == -(-len(state.token_ids) // 4)

    # Committed since: d1 (accepted), x (d2 corrected), then y from a step without drafts.
    x, y = (d[1] + 1) % 256, 77
    for token in (d[0], x, y):
        r.append_output(token)
    state = drafter.sync(r)
    assert state.token_ids == context + d[:1]
    assert len(state.block_ids) == -(-len(state.token_ids) // 4)
    assert len(drafter.free_blocks) == 64 - len(state.block_ids)

    fed.clear()
    again = drafter.propose([r], [K])[0].token_ids
    assert fed[0] == [x, y]  # only the ids the draft had not seen
    fresh = load_drafter(tiny_model_dir).propose([r], [K])[0].token_ids
    assert again == fresh  # the kept K/V is the K/V of the committed ids

    # Nothing new committed: the last committed id runs again for its logits.
    fed.clear()
    assert drafter.propose([r], [K])[0].token_ids == again
    assert fed[0] == [y]

    drafter.on_finished(r)
    assert not drafter.states and len(drafter.free_blocks) == 64


def test_a_full_pool_drops_idle_states_first(tiny_model_dir):
    # 5 blocks of 4: a 10-id context with 4 drafts needs 13 slots, 4 blocks.
    drafter = load_drafter(tiny_model_dir, num_blocks=5)
    a = request("a", PROMPTS["r0"] + [1, 2, 3])
    b = request("b", PROMPTS["r1"] + [1, 2, 3])
    assert len(drafter.propose([a], [K])[0].token_ids) == K
    assert len(drafter.propose([b], [K])[0].token_ids) == K  # a was idle: dropped
    assert list(drafter.states) == ["b"]
    # Both in one batch: a cannot evict b, so a gets no draft and keeps no state.
    got = drafter.propose([a, b], [K, K])
    assert got[0].token_ids == [] and len(got[1].token_ids) == K
    assert list(drafter.states) == ["b"]
    assert len(drafter.free_blocks) == 1


def test_drafts_never_see_the_forced_suffix(tiny_model_dir):
    check_drafts_ignore_the_forced_suffix(lambda: draft_engine(tiny_model_dir, tiny_model_dir))


def test_draft_vocabulary_must_fit_the_target(tiny_model_dir, baseline, tmp_path):
    big = make_tiny_model(tmp_path / "big", vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary of 512 ids but the target has 256"):
        draft_engine(tiny_model_dir, big)
    # A smaller vocabulary maps 1:1: output unchanged (prompts hold ids past it), and
    # sampled drafts' probs are padded to the target's vocabulary with zeros.
    small = make_tiny_model(tmp_path / "small", vocab_size=200)
    engine = draft_engine(tiny_model_dir, small)
    out = engine.generate([greedy(r, p) for r, p in PROMPTS.items()])
    assert {rid: tokens_of(d) for rid, d in out.items()} == baseline
    sampled = request("s", PROMPTS["r0"], temperature=1.0, seed=3)
    draft = engine.drafter.propose([sampled], [K])[0]
    assert draft.probs.shape == (K, 256)
    assert (draft.probs[:, 200:] == 0).all()
    assert all(t < 200 for t in draft.token_ids)
