import asyncio
import time

import pytest

from once.engine.scripted import ScriptedEngine
from once.protocol.engine import EngineClient, GenerateRequest, SamplingParams, TokenDelta
from once.protocol.errors import ContextLengthExceededError, OnceError


def make_request(request_id="r1", prompt=(1, 2, 3), **kwargs) -> GenerateRequest:
    sampling = SamplingParams(**kwargs.pop("sampling", {}))
    return GenerateRequest(request_id, tuple(prompt), sampling=sampling, **kwargs)


async def collect(engine, request) -> list[TokenDelta]:
    async def run():
        return [delta async for delta in engine.generate(request)]

    return await asyncio.wait_for(run(), timeout=5)


def output_ids(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_is_an_engine_client():
    assert isinstance(ScriptedEngine(), EngineClient)


async def test_script_list_consumed_in_order_one_token_per_delta():
    engine = ScriptedEngine([[10, 11, 12], [20]])
    first = await collect(engine, make_request("a"))
    assert [d.token_ids for d in first] == [[10], [11], [12]]
    assert first[-1].finish_reason == "length"
    assert first[0].num_cached_tokens == 0 and first[1].num_cached_tokens is None
    assert all(d.finish_reason is None for d in first[:-1])
    assert output_ids(await collect(engine, make_request("b"))) == [20]
    with pytest.raises(OnceError, match="ran out"):
        await collect(engine, make_request("c"))


async def test_callable_script_and_tokens_per_delta():
    engine = ScriptedEngine(lambda req: [t * 2 for t in req.prompt_token_ids], tokens_per_delta=2)
    deltas = await collect(engine, make_request(prompt=[1, 2, 3, 4, 5]))
    assert [d.token_ids for d in deltas] == [[2, 4], [6, 8], [10]]


async def test_forced_output_ids_win_over_script_and_max_tokens_truncates():
    engine = ScriptedEngine([[9, 9, 9]])
    request = make_request(forced_output_ids=(5, 6, 7, 8), sampling={"max_tokens": 3})
    deltas = await collect(engine, request)
    assert output_ids(deltas) == [5, 6, 7]
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].metrics.num_output_tokens == 3


async def test_eos_and_stop_tokens_end_with_stop_and_are_included():
    engine = ScriptedEngine([[1, 2, 0, 4], [1, 7, 2], [1, 0, 3]], eos_token_id=0)
    deltas = await collect(engine, make_request("eos"))
    assert output_ids(deltas) == [1, 2, 0] and deltas[-1].finish_reason == "stop"
    deltas = await collect(engine, make_request("stop", sampling={"stop_token_ids": (7,)}))
    assert output_ids(deltas) == [1, 7] and deltas[-1].finish_reason == "stop"
    deltas = await collect(engine, make_request("ignore", sampling={"ignore_eos": True}))
    assert output_ids(deltas) == [1, 0, 3] and deltas[-1].finish_reason == "length"


async def test_prefix_cache_counts_full_blocks_and_isolates_salts():
    engine = ScriptedEngine([[100]] * 5, block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    deltas = await collect(engine, make_request("cold", prompt))
    assert deltas[0].num_cached_tokens == 0
    assert deltas[-1].metrics.num_computed_tokens == 10

    # Same prefix, longer prompt: both full blocks hit.
    deltas = await collect(engine, make_request("warm", prompt + [11, 12, 13]))
    assert deltas[0].num_cached_tokens == 8
    assert deltas[-1].metrics.num_cached_tokens == 8
    assert deltas[-1].metrics.num_computed_tokens == 5

    # A divergent second block only matches the first.
    deltas = await collect(engine, make_request("fork", [1, 2, 3, 4, 99, 6, 7, 8, 9]))
    assert deltas[0].num_cached_tokens == 4

    # Another tenant's salt never sees these blocks.
    deltas = await collect(engine, make_request("tenant", prompt, cache_salt="other"))
    assert deltas[0].num_cached_tokens == 0

    # A fully cached 8-token prompt still computes its last token: only 1 block counts.
    deltas = await collect(engine, make_request("exact", prompt[:8]))
    assert deltas[0].num_cached_tokens == 4

    stats = await engine.stats()
    assert stats["num_prompt_tokens"] == 10 + 13 + 9 + 10 + 8
    assert stats["num_cached_prompt_tokens"] == 8 + 4 + 4
    assert stats["num_computed_prompt_tokens"] == 50 - 16
    assert stats["prefix_cache_hit_rate"] == pytest.approx(16 / 50)


async def test_output_blocks_are_cached_for_the_next_turn():
    engine = ScriptedEngine([[5, 6, 7, 8, 9], [1]], block_size=4)
    await collect(engine, make_request("turn1", [1, 2, 3, 4]))
    # The next turn's prompt = prompt + output + new: blocks [1..4] and [5..8] are cached.
    deltas = await collect(engine, make_request("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 50]))
    assert deltas[0].num_cached_tokens == 8


async def test_abort_ends_a_running_stream():
    engine = ScriptedEngine([list(range(100))], token_latency_s=0.05)
    request = make_request("slow")
    deltas: list[TokenDelta] = []

    async def consume():
        async for delta in engine.generate(request):
            deltas.append(delta)
            if len(deltas) == 2:
                await engine.abort("slow")

    start = time.monotonic()
    await asyncio.wait_for(consume(), timeout=5)
    assert time.monotonic() - start < 1.0
    assert deltas[-1].finish_reason == "abort" and deltas[-1].token_ids == []
    assert deltas[-1].metrics.num_output_tokens == 2
    assert engine.finish_reasons["slow"] == "abort"
    stats = await engine.stats()
    assert stats["num_running"] == 0 and stats["num_requests_aborted"] == 1
    await engine.abort("unknown-id")  # a no-op, not an error


async def test_closing_the_stream_counts_as_abort():
    engine = ScriptedEngine([list(range(100))])
    stream = engine.generate(make_request("closed"))
    await anext(stream)
    assert (await engine.stats())["num_running"] == 1
    await stream.aclose()
    stats = await engine.stats()
    assert stats["num_running"] == 0 and stats["num_requests_aborted"] == 1


async def test_latency_is_respected():
    engine = ScriptedEngine([[1, 2, 3, 4, 5]], ttft_s=0.05, token_latency_s=0.01)
    start = time.monotonic()
    deltas = await collect(engine, make_request())
    elapsed = time.monotonic() - start
    assert 0.09 <= elapsed < 1.0
    metrics = deltas[-1].metrics
    assert metrics.ttft_s >= 0.05
    assert metrics.mean_token_latency_s >= 0.01
    assert metrics.e2e_s >= metrics.ttft_s


async def test_prompt_longer_than_max_model_len_fails_on_first_iteration():
    engine = ScriptedEngine(max_model_len=8)
    stream = engine.generate(make_request(prompt=range(1, 10)))
    with pytest.raises(ContextLengthExceededError) as info:
        await anext(stream)
    assert info.value.code == "context_length_exceeded" and info.value.status == 400
    # Output is cut at the context limit: 6 prompt tokens leave room for 2.
    deltas = await collect(engine, make_request("fits", prompt=range(1, 7)))
    assert output_ids(deltas) == [1, 2] and deltas[-1].finish_reason == "length"


async def test_stats_keys():
    stats = await ScriptedEngine().stats()
    for key in (
        "num_running",
        "num_waiting",
        "num_requests_finished",
        "num_prompt_tokens",
        "num_cached_prompt_tokens",
        "num_computed_prompt_tokens",
        "num_generated_tokens",
        "prefix_cache_hit_rate",
    ):
        assert key in stats


async def test_lru_eviction_bounds_the_cache():
    engine = ScriptedEngine([[100]] * 3, block_size=2, max_cached_blocks=2)
    await collect(engine, make_request("a", [1, 2, 3, 4, 5]))  # caches 2 blocks (+ output)
    await collect(engine, make_request("b", [7, 8, 9, 10, 11]))  # evicts a's blocks
    stats = await engine.stats()
    assert stats["num_kv_blocks_cached"] == 2 and stats["num_kv_evictions"] >= 2
    deltas = await collect(engine, make_request("c", [1, 2, 3, 4, 5]))
    assert deltas[0].num_cached_tokens == 0
