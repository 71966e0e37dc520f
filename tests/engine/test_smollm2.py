"""The real default model: the engine matches transformers token for token."""

import pytest
import torch

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.loader import resolve_model_path
from once.engine.testing import reference_model
from once.model_files import load_tokenizer
from once.protocol.engine import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    folder = resolve_model_path("smollm2-135m-instruct")
    engine = LLMEngine(
        EngineConfig(model=str(folder), kv_cache_gib=0.25, max_num_batched_tokens=64)
    )
    return engine, reference_model(folder, attn_implementation="sdpa"), load_tokenizer(folder)


def chat_ids(tokenizer, text):
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_greedy_generation_is_token_identical_to_transformers(smollm2):
    engine, reference, tokenizer = smollm2
    prompts = [
        chat_ids(tokenizer, "Write a Python function that reverses a string."),
        chat_ids(tokenizer, "What is the capital of France?"),
    ]
    requests = [
        GenerateRequest(f"p{i}", tuple(p), SamplingParams(temperature=0, max_tokens=24))
        for i, p in enumerate(prompts)
    ]
    out = engine.generate(requests)  # both in one batch, prefilled in 64-token chunks
    for request, prompt in zip(requests, prompts, strict=True):
        got = [t for d in out[request.request_id] for t in d.token_ids]
        with torch.no_grad():
            want = reference.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, attention_mask=None
            )[0, len(prompt) :].tolist()
        assert got == want, tokenizer.decode(got) + " | " + tokenizer.decode(want)


def test_logits_match_transformers_with_prefix_hit(smollm2):
    engine, reference, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "List three sorting algorithms and their complexity.")
    engine.generate(
        [GenerateRequest("warm", tuple(prompt), SamplingParams(temperature=0, max_tokens=4))]
    )
    captured = []
    execute = engine.runner.execute

    def recording(scheduled):
        logits, sampled = execute(scheduled)
        captured.extend((list(s.request.all_token_ids), logits[i]) for i, s in enumerate(sampled))
        return logits, sampled

    engine.runner.execute = recording
    try:
        longer = prompt + tokenizer.encode(" And explain merge sort.")
        out = engine.generate(
            [GenerateRequest("hit", tuple(longer), SamplingParams(temperature=0, max_tokens=3))]
        )
    finally:
        engine.runner.execute = execute
    assert out["hit"][0].num_cached_tokens >= 16
    for tokens, logits in captured:
        with torch.no_grad():
            want = reference(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits, want, atol=2e-3, rtol=1e-3)


def test_greedy_logprobs_are_log_softmax_of_transformers_logits(smollm2):
    engine, reference, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Name a primary color.")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    deltas = engine.generate([GenerateRequest("lp", tuple(prompt), params)])["lp"]
    output = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs or []]
    assert [e.token_id for e in entries] == output and len(output) == 8
    for position, entry in enumerate(entries):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output[:position]])).logits[0, -1]
        want = torch.log_softmax(logits.float(), -1)
        assert entry.logprob == pytest.approx(float(want[entry.token_id]), abs=2e-3)
        assert entry.top_logprobs[0][0] == entry.token_id  # greedy: the argmax
        values = [value for _, value in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Each alternative's value, and the top 5 as a whole (near-ties may swap ids).
        for token_id, value in entry.top_logprobs:
            assert value == pytest.approx(float(want[token_id]), abs=2e-3)
        torch.testing.assert_close(torch.tensor(values), want.topk(5).values, atol=2e-3, rtol=0)
