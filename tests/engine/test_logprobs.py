"""Logprobs on the tiny model: each reported value is `torch.log_softmax` of transformers'
logits for the same tokens (the raw distribution, whatever the sampling settings), for
plain decodes, chunked prefills with prefix hits, forced ids, verification rows and
grammar-masked rows; requests that do not ask are untouched."""

import math

import pytest
import torch

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.speculative import Draft
from once.engine.testing import byte_grammar_tokenizer
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams

ATOL = 1e-4


def make_engine(model_dir, **overrides):
    config = dict(model=str(model_dir), block_size=4, num_kv_blocks=256, seed=0)
    return LLMEngine(
        EngineConfig(**(config | overrides)), grammar_tokenizer=byte_grammar_tokenizer()
    )


def prompts(seed, lengths, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def request(rid, prompt, **sampling):
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True} | sampling
    return GenerateRequest(rid, tuple(prompt), SamplingParams(**sampling))


def tokens_of(deltas):
    return [t for d in deltas for t in d.token_ids]


def logprobs_of(deltas):
    entries = []
    for delta in deltas:
        if delta.token_ids:
            assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
            assert [e.token_id for e in delta.logprobs] == delta.token_ids
            entries.extend(delta.logprobs)
        else:
            assert not delta.logprobs
    return entries


def reference_logprobs(reference, tokens) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([tokens])).logits[0, -1].float(), -1)


def check_against_reference(reference, prompt, deltas, k):
    """Every output position: the id's logprob and the top k (ids and values, sorted)
    equal log_softmax of transformers' logits after prompt + the ids before it."""
    output = tokens_of(deltas)
    entries = logprobs_of(deltas)
    assert len(entries) == len(output) > 0
    for position, entry in enumerate(entries):
        want = reference_logprobs(reference, list(prompt) + output[:position])
        assert entry.logprob == pytest.approx(float(want[entry.token_id]), abs=ATOL)
        assert len(entry.top_logprobs) == k
        if k:
            values = [value for _, value in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
            top = want.topk(k)
            assert [i for i, _ in entry.top_logprobs] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(values), top.values, atol=ATOL, rtol=0)
            rank = int((want > want[entry.token_id]).sum())  # ids strictly more likely
            in_top = entry.token_id in [i for i, _ in entry.top_logprobs]
            assert in_top == (rank < k)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_greedy_logprobs_match_transformers_in_a_mixed_batch(
    tiny_model_dir, tiny_reference, use_kernel
):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    engine.runner.use_kernel = use_kernel
    shared = prompts(0, [13])[0]
    batch = [shared + p for p in prompts(1, [5, 30])] + prompts(2, [17, 2])
    ks = [0, 1, 5, 20]
    engine.generate([request("warm", shared, max_tokens=2)])  # later prompts hit its blocks
    requests = [
        request(f"r{i}", p, logprobs=k) for i, (p, k) in enumerate(zip(batch, ks, strict=True))
    ]
    out = engine.generate(requests)
    assert out["r0"][0].num_cached_tokens > 0
    for r, k in zip(requests, ks, strict=True):
        check_against_reference(tiny_reference, r.prompt_token_ids, out[r.request_id], k)
        # Greedy: the id is the argmax, first of its alternatives when any were asked for.
        for entry in logprobs_of(out[r.request_id]):
            assert not k or entry.top_logprobs[0][0] == entry.token_id


def test_sampled_rows_report_the_raw_distribution(tiny_model_dir, tiny_reference):
    # Temperature, top-k and top-p change which id is drawn, not the reported values: the
    # logprobs are of the model's own distribution (engine/logprobs.py).
    engine = make_engine(tiny_model_dir)
    prompt = prompts(3, [9])[0]
    sampling = dict(temperature=1.7, top_k=40, top_p=0.9, seed=11, max_tokens=10)
    out = engine.generate([request("s", prompt, logprobs=3, **sampling)])["s"]
    check_against_reference(tiny_reference, prompt, out, 3)
    entries = logprobs_of(out)
    assert any(e.token_id != e.top_logprobs[0][0] for e in entries)  # some draw off the top
    alone = make_engine(tiny_model_dir).generate([request("s", prompt, **sampling)])["s"]
    assert tokens_of(alone) == tokens_of(out)  # asking changes nothing that is drawn


def test_requests_that_do_not_ask_are_token_identical_to_running_alone(tiny_model_dir):
    plain_greedy = request("plain", prompts(4, [11])[0], max_tokens=12)
    plain_sampled = request("seeded", prompts(5, [7])[0], temperature=1.0, seed=3, max_tokens=12)
    asking = [request(f"ask{i}", p, logprobs=5) for i, p in enumerate(prompts(6, [3, 26]))]
    alone = {
        r.request_id: make_engine(tiny_model_dir).generate([r])[r.request_id]
        for r in (plain_greedy, plain_sampled)
    }
    mixed = make_engine(tiny_model_dir, max_num_batched_tokens=16).generate(
        [plain_greedy, *asking, plain_sampled]
    )
    for rid, deltas in alone.items():
        assert tokens_of(mixed[rid]) == tokens_of(deltas)
        assert all(d.logprobs is None and "logprobs" not in d.to_dict() for d in mixed[rid])
    assert all(logprobs_of(mixed[r.request_id]) for r in asking)


def test_forced_outputs_report_the_logprobs_of_the_forced_ids(tiny_model_dir, tiny_reference):
    engine = make_engine(tiny_model_dir)
    prompt, forced = prompts(7, [10, 6])
    replay = GenerateRequest(
        "replay", tuple(prompt), SamplingParams(logprobs=4), forced_output_ids=tuple(forced)
    )
    out = engine.generate([replay])["replay"]
    assert tokens_of(out) == forced
    check_against_reference(tiny_reference, prompt, out, 4)


class AnswerDrafter:
    """Drafts each request's known greedy continuation (none for a request it has no
    answer for), the second id of every third draft wrong, so verifications accept all,
    some, and none of their drafts, beside plain decodes."""

    def __init__(self, answers: dict[str, list[int]], prompts: dict[str, list[int]]):
        self.answers, self.prompts = answers, prompts
        self.num_proposals = dict.fromkeys(answers, 0)

    def propose(self, requests, max_tokens):
        drafts = []
        for r, k in zip(requests, max_tokens, strict=True):
            done = len(r.all_token_ids) - len(self.prompts[r.request_id])
            draft = list(self.answers.get(r.request_id, [])[done : done + k])
            if draft:
                self.num_proposals[r.request_id] += 1
            if len(draft) > 1 and self.num_proposals[r.request_id] % 3 == 0:
                draft[1] = (draft[1] + 1) % 256
            drafts.append(Draft(draft))
        return drafts

    def on_finished(self, request):
        pass


def test_each_accepted_token_gets_its_verification_row(tiny_model_dir, tiny_reference):
    # Verifications of different lengths and a plain decode share steps: each request's
    # rows are found past the others' 1 + k rows.
    batch = dict(zip(["v0", "v1", "plain"], prompts(8, [9, 6, 12]), strict=True))
    requests = [request(rid, p, max_tokens=20, logprobs=2) for rid, p in batch.items()]
    plain = make_engine(tiny_model_dir).generate(requests)
    answers = {rid: tokens_of(plain[rid]) for rid in ("v0", "v1")}
    engine = make_engine(tiny_model_dir, num_speculative_tokens=4)
    engine.drafter = AnswerDrafter(answers, batch)
    out = engine.generate(requests)
    stats = engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    for rid, prompt in batch.items():
        assert tokens_of(out[rid]) == tokens_of(plain[rid])
        check_against_reference(tiny_reference, prompt, out[rid], 2)
    assert max(len(d.token_ids) for d in out["v0"]) > 1  # deltas of several verified ids


def test_a_stop_inside_a_verification_cuts_the_logprobs_with_the_ids(tiny_model_dir):
    prompt = prompts(9, [9])[0]
    plain = make_engine(tiny_model_dir).generate([request("v", prompt, max_tokens=12)])["v"]
    answer = tokens_of(plain)
    stop = answer[6]
    engine = make_engine(tiny_model_dir, num_speculative_tokens=6)
    engine.drafter = AnswerDrafter({"v": answer}, {"v": prompt})
    out = engine.generate(
        [request("v", prompt, max_tokens=12, logprobs=1, stop_token_ids=(stop,), ignore_eos=False)]
    )["v"]
    assert tokens_of(out) == answer[: answer.index(stop) + 1]
    assert len(logprobs_of(out)) == len(tokens_of(out))


def test_constrained_rows_report_the_masked_distribution(tiny_model_dir, tiny_reference):
    # The byte vocabulary: a-e are ids 97-101; after 3 letters eos (2) is allowed too.
    engine = make_engine(tiny_model_dir)
    prompt = tuple(range(40, 60))
    letters = OutputConstraint("regex", "[a-e]{3,12}")
    params = SamplingParams(temperature=0.0, max_tokens=12, constraint=letters, logprobs=8)
    out = engine.generate([GenerateRequest("c", prompt, params)])["c"]
    output = tokens_of(out)
    for position, entry in enumerate(logprobs_of(out)):
        allowed = {97, 98, 99, 100, 101} | ({2} if position >= 3 else set())
        # Fewer ids are possible than asked for: the alternatives are all of them, no more.
        assert {i for i, _ in entry.top_logprobs} == allowed
        assert math.fsum(math.exp(v) for _, v in entry.top_logprobs) == pytest.approx(1.0)
        with torch.no_grad():
            logits = tiny_reference(torch.tensor([list(prompt) + output[:position]])).logits
        masked = logits[0, -1, sorted(allowed)].float()
        want = masked - torch.logsumexp(masked, -1)
        got = dict(entry.top_logprobs)
        assert [got[i] for i in sorted(allowed)] == pytest.approx(want.tolist(), abs=ATOL)
        assert entry.logprob == pytest.approx(got[entry.token_id])
