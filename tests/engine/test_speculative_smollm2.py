"""SmolLM2: free greedy output is identical with and without speculation."""

import gc

import pytest

from once.bench.traces import MINI_SWE_AGENT, load_sessions
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.loader import resolve_model_path
from once.model_files import load_tokenizer
from once.protocol.engine import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow


def chat_prompts(tokenizer):
    texts = [
        "Write a Python function that reverses a string, then call it on 'hello'.",
        "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3,
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for t in texts
    ]  # fmt: skip
    session = load_sessions(source=MINI_SWE_AGENT, limit=1)[0]
    for call in session.calls[1:3]:  # agent-session prompts, cut to their last 600 ids
        messages = [{"role": m["role"], "content": m["content"]} for m in call.messages]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(ids[-600:])
    return prompts


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_free_greedy_is_identical_with_speculation(method):
    folder = resolve_model_path("smollm2-135m-instruct")
    prompts = chat_prompts(load_tokenizer(folder))
    outputs = []
    for spec in ("", method):
        engine = LLMEngine(
            EngineConfig(model=str(folder), kv_cache_gib=0.25, speculative_method=spec)
        )
        requests = [
            GenerateRequest(f"p{i}", tuple(p), SamplingParams(temperature=0, max_tokens=48))
            for i, p in enumerate(prompts)
        ]
        out = engine.generate(requests)
        outputs.append({rid: [t for d in ds for t in d.token_ids] for rid, ds in out.items()})
        if spec:
            assert engine.stats()["num_accepted_tokens"] > 0
        # One SmolLM2 engine at a time (~1.3 GB: weights, their packed copy, KV). The engine
        # is in reference cycles (its own bound methods, given to its KV manager), so only
        # a collection frees it.
        del engine
        gc.collect()
    assert outputs[0] == outputs[1]
