"""Engine behavior: sampling, stops, forced outputs, aborts, accounting, bad input."""

import asyncio

import pytest
import torch

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
)


@pytest.fixture
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64))


def tokens_of(deltas):
    return [t for d in deltas for t in d.token_ids]


def req(rid, prompt, **sampling):
    sampling.setdefault("max_tokens", 8)
    return GenerateRequest(rid, tuple(prompt), SamplingParams(**sampling))


def assert_all_blocks_free(engine):
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.pool.blocks)
    assert not engine.kv.req_blocks


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = dict(temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = engine.generate([req("a", [5, 6, 7], **params)])
    mixed = engine.generate(
        [req("x", [9, 9, 9, 9, 9], temperature=1.0, ignore_eos=True), req("b", [5, 6, 7], **params)]
    )
    assert tokens_of(alone["a"]) == tokens_of(mixed["b"])
    other_seed = engine.generate([req("c", [5, 6, 7], **(params | {"seed": 8}))])
    assert tokens_of(other_seed["c"]) != tokens_of(alone["a"])


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate([req("g", [3, 4, 5], temperature=0, ignore_eos=True)])
    top1 = engine.generate([req("k", [3, 4, 5], temperature=1.5, top_k=1, ignore_eos=True)])
    assert tokens_of(greedy["g"]) == tokens_of(top1["k"])


def test_stop_token_and_max_tokens(engine):
    free_run = tokens_of(
        engine.generate([req("a", [3, 4, 5], temperature=0, ignore_eos=True)])["a"]
    )
    stop_at = free_run[2]
    out = engine.generate(
        [req("b", [3, 4, 5], temperature=0, ignore_eos=True, stop_token_ids=(stop_at,))]
    )["b"]
    assert tokens_of(out) == free_run[: free_run.index(stop_at) + 1]
    assert out[-1].finish_reason == "stop"
    out = engine.generate([req("c", [3, 4, 5], temperature=0, ignore_eos=True, max_tokens=3)])["c"]
    assert len(tokens_of(out)) == 3 and out[-1].finish_reason == "length"


def test_forced_outputs_are_emitted_and_cost_one_forward_each(engine):
    forced = (10, 11, 12, 13, 14)
    request = GenerateRequest(
        "f", (3, 4, 5, 6), SamplingParams(max_tokens=100), forced_output_ids=forced
    )
    steps_before = engine.stats()["num_steps"]
    out = engine.generate([request])["f"]
    assert tuple(tokens_of(out)) == forced
    assert out[-1].finish_reason == "length"
    assert engine.stats()["num_steps"] - steps_before == len(forced)
    # The forced tokens are now in the cache: the next turn hits prompt + outputs.
    nxt = engine.generate([req("n", (3, 4, 5, 6) + forced + (20, 21), temperature=0)])["n"]
    assert nxt[0].num_cached_tokens == 8


def test_accounting_per_request_and_engine(engine):
    out = engine.generate([req("a", range(3, 13), temperature=0, ignore_eos=True, max_tokens=4)])
    m = out["a"][-1].metrics
    assert (m.num_prompt_tokens, m.num_cached_tokens, m.num_computed_tokens) == (10, 0, 10)
    assert m.num_output_tokens == 4 and m.ttft_s > 0 and m.e2e_s >= m.ttft_s
    out = engine.generate([req("b", range(3, 17), temperature=0, ignore_eos=True, max_tokens=4)])
    m = out["b"][-1].metrics
    assert out["b"][0].num_cached_tokens == 8 == m.num_cached_tokens
    assert m.num_computed_tokens == 14 - 8
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 8 and stats["prefix_cache_query_tokens"] == 24
    assert stats["num_computed_prompt_tokens"] == 16 and stats["num_requests_finished"] == 2
    assert_all_blocks_free(engine)


def test_abort_frees_blocks_mid_flight(engine):
    engine.add_request(req("a", range(3, 30), ignore_eos=True, max_tokens=50))
    engine.add_request(req("b", range(3, 12), ignore_eos=True, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.abort_request("a")
    engine.abort_request("never-existed")
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
        engine.abort_request("b")
    reasons = {d.request_id: d.finish_reason for d in deltas if d.finished}
    assert reasons == {"a": "abort", "b": "abort"}
    assert_all_blocks_free(engine)


def test_the_context_is_what_the_cache_holds_so_any_admitted_request_can_run(engine):
    assert engine.max_model_len == engine.pool.num_blocks * engine.config.block_size == 256
    out = engine.generate([req("long", range(3, 200), ignore_eos=True, max_tokens=400)])
    assert len(tokens_of(out["long"])) == 256 - 197  # to the end of the context: "length"
    assert_all_blocks_free(engine)


def test_more_requests_than_the_cache_holds_wait_their_turn(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=12, max_num_seqs=8)
    )
    requests = [
        req(f"r{i}", range(3 + i, 23 + i), ignore_eos=True, max_tokens=20) for i in range(6)
    ]
    out = engine.generate(requests)
    assert all(len(tokens_of(out[r.request_id])) == 20 for r in requests)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("request_factory", "error"),
    [
        (lambda: req("long", range(3, 600)), ContextLengthExceededError),
        (lambda: req("vocab", [5, 999]), InvalidRequestError),
        # Past the cache (256 tokens) though within the model's 512 positions.
        (lambda: req("past-cache", range(3, 300)), ContextLengthExceededError),
        (
            lambda: GenerateRequest("f", (3,), forced_output_ids=(1, 5000)),
            InvalidRequestError,
        ),
    ],
)
def test_bad_requests_are_rejected_and_nothing_leaks(engine, request_factory, error):
    engine.generate([req("before", [4, 5, 6], ignore_eos=True)])
    with pytest.raises(error) as info:
        engine.add_request(request_factory())
    assert info.value.code and info.value.status == 400
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
    # The engine still serves, and the earlier prefix is still cached.
    out = engine.generate([req("after", [4, 5, 6, 7, 8])])
    assert out["after"][-1].finish_reason in ("stop", "length")


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request(req("same", [3, 4]))
    with pytest.raises(InvalidRequestError):
        engine.add_request(req("same", [3, 4]))


def test_invalid_sampling_params_raise_clear_errors():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError):
        GenerateRequest("x", ())


async def test_async_engine_streams_and_aborts_on_cancel(tiny_model_dir):
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64)
    )
    try:

        async def collect(rid, prompt, **kw):
            return [d async for d in engine.generate(req(rid, prompt, **kw))]

        a, b = await asyncio.gather(
            collect("a", [3, 4, 5], temperature=0, ignore_eos=True),
            collect("b", [6, 7, 8, 9], temperature=0, ignore_eos=True),
        )
        assert len(tokens_of(a)) == 8 and a[-1].finish_reason == "length"
        assert a[0].num_cached_tokens == 0 and a[-1].metrics.num_output_tokens == 8
        sync_ref = LLMEngine(
            EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64)
        )
        want = sync_ref.generate([req("a", [3, 4, 5], temperature=0, ignore_eos=True)])["a"]
        assert tokens_of(a) == tokens_of(want)

        with pytest.raises(ContextLengthExceededError):
            await collect("long", range(3, 600))

        # A consumer that goes away mid-stream: its request is aborted, blocks come back.
        stream = engine.generate(req("c", [3, 4, 5], ignore_eos=True, max_tokens=200))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            stats = await engine.stats()
            if stats["num_kv_blocks_used"] == 0 and stats["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        assert stats["num_kv_blocks_used"] == 0 and stats["num_requests_aborted"] == 1
    finally:
        await engine.close()


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_kernel_and_torch_paths_agree_on_long_decode(tmp_path, head_dim):
    from once.engine.testing import make_tiny_model

    # head_dim 64 and 128 take the kernel's vectorized path, others its scalar path;
    # contexts longer than one decode partition exercise the split-K merge.
    folder = make_tiny_model(tmp_path / "m", hidden_size=64, head_dim=head_dim)
    prompt = torch.randint(3, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for use_kernel in (True, False):
        engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, num_kv_blocks=128))
        engine.runner.use_kernel = use_kernel
        batch = [
            req("a", prompt, temperature=0, ignore_eos=True),
            req("b", prompt[:50], temperature=0),
        ]
        out = engine.generate(batch)
        results.append([tokens_of(out["a"]), tokens_of(out["b"])])
    assert results[0] == results[1]
