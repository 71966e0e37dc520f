"""The paged engine computes the same logits as transformers for the same weights.

Each test runs the engine step by step, captures the logits of every sampled row, and
compares them with a plain transformers forward over the same tokens. Batches are built
to mix prefills, chunked prefills, decodes and prefix hits in single steps.
"""

import pytest
import torch

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.testing import make_tiny_model, reference_model
from once.protocol.engine import GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def capture_logits(engine: LLMEngine):
    """Wrap the runner so each sampled row's logits are recorded with its tokens so far."""
    records = []
    execute = engine.runner.execute

    def recording_execute(scheduled):
        logits, sampled = execute(scheduled)
        kinds = {s.request.request_id: s.num_new_tokens for s in scheduled}
        for row, item in enumerate(sampled):
            request = item.request
            records.append((list(request.all_token_ids), logits[row].clone(), kinds))
        return logits, sampled

    engine.runner.execute = recording_execute
    return records


def assert_logits_match(reference, records, atol=1e-4):
    assert records
    for tokens, logits, _ in records:
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=atol, rtol=1e-4)


def make_engine(model_dir, **overrides):
    defaults = dict(model=str(model_dir), block_size=4, num_kv_blocks=128)
    return LLMEngine(EngineConfig(**(defaults | overrides)))


def prompts(seed, lengths, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_mixed_batch_logits_match_transformers(tiny_model_dir, tiny_reference, use_kernel):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    engine.runner.use_kernel = use_kernel
    records = capture_logits(engine)
    shared = prompts(0, [13])[0]
    batch = [shared + p for p in prompts(1, [5, 30, 1])] + prompts(2, [17, 2])
    for i, p in enumerate(batch):
        engine.add_request(GenerateRequest(f"r{i}", tuple(p), GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
    # Some step must have mixed decodes (1 new token) with multi-token prefill chunks.
    assert any(1 in kinds.values() and max(kinds.values()) > 1 for *_, kinds in records)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    assert_logits_match(tiny_reference, records)


def test_prefix_hit_then_chunked_prefill_matches(tiny_model_dir, tiny_reference):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8)
    records = capture_logits(engine)
    base = prompts(3, [21])[0]
    engine.generate([GenerateRequest("a", tuple(base), GREEDY)])
    out = engine.generate([GenerateRequest("b", tuple(base + prompts(4, [19])[0]), GREEDY)])
    assert out["b"][0].num_cached_tokens == 20  # 5 full blocks of 4 reused
    assert out["b"][-1].metrics.num_computed_tokens == 40 - 20
    assert_logits_match(tiny_reference, records)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "mistral"])
def test_other_families_match(tmp_path, architecture):
    folder = make_tiny_model(tmp_path / architecture, architecture=architecture)
    reference = reference_model(folder)
    engine = make_engine(folder, max_num_batched_tokens=16)
    records = capture_logits(engine)
    engine.generate(
        [GenerateRequest(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(prompts(5, [9, 20]))]
    )
    assert_logits_match(reference, records)


def test_tied_embeddings_match(tmp_path):
    folder = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    reference = reference_model(folder)
    engine = make_engine(folder)
    records = capture_logits(engine)
    engine.generate([GenerateRequest("r", tuple(prompts(6, [11])[0]), GREEDY)])
    assert_logits_match(reference, records)


def test_preemption_recomputes_to_the_same_tokens(tiny_model_dir):
    batch = prompts(7, [10, 11, 12, 13])
    requests = [
        GenerateRequest(
            f"r{i}", tuple(p), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
        for i, p in enumerate(batch)
    ]
    roomy = make_engine(tiny_model_dir).generate(requests)
    tight = make_engine(tiny_model_dir, num_kv_blocks=14, enable_prefix_caching=False)
    result = tight.generate(requests)
    assert tight.stats()["num_preemptions"] > 0
    for r in requests:
        got = [t for d in result[r.request_id] for t in d.token_ids]
        want = [t for d in roomy[r.request_id] for t in d.token_ids]
        assert got == want
    assert tight.pool.num_free_blocks == tight.pool.num_blocks


def test_connector_moves_kv_between_engines_with_identical_logits(tiny_model_dir, tiny_reference):
    from once.engine.kv.memory_connector import HostMemoryConnector

    connector = HostMemoryConnector()
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=128)
    first = LLMEngine(config, connector=connector)
    prompt = prompts(9, [22])[0]
    first.generate([GenerateRequest("a", tuple(prompt), GREEDY)])
    assert connector.num_saved == (22 + 5) // 4  # every full block of prompt + outputs

    # A fresh engine with an empty device cache gets the prefix through the connector.
    second = LLMEngine(config, connector=connector)
    records = capture_logits(second)
    out = second.generate([GenerateRequest("b", tuple(prompt + [7, 8, 9]), GREEDY)])
    assert out["b"][0].num_cached_tokens == 20 and connector.num_loaded == 5
    assert second.stats()["external_kv_hit_tokens"] == 20
    assert_logits_match(tiny_reference, records)
    assert second.pool.num_free_blocks == second.pool.num_blocks
