"""The router's disaggregated path: vLLM's prefill/decode protocol against the fake vLLM,
through `once router`'s own app, and over once's engines with real KV transfer."""

import httpx
import pytest

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.scripted import ScriptedEngine
from once.engine.testing import make_tiny_model
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app
from once.router import OpenAICompletionsClient, Router, RouterConfig
from once.router.disagg.split import SplitPolicy
from once.router.replicas import Replica, in_process_replica
from once.router.serve import build_parser, build_router
from tests.router.fake_vllm import build_fake_vllm, serve_app
from tests.router.fakes import collect, make_request

PROMPT = list(range(10, 74))  # 4 blocks of 16
EAGER = SplitPolicy(min_uncached_tokens=32, min_decoding=0, ttft_budget_s=1e6)


def pd_router(prefill_client, decode_client, split=EAGER) -> Router:
    replicas = [
        Replica("prefill", prefill_client, index=0, role="prefill"),
        Replica("decode", decode_client, index=1, role="decode"),
    ]
    return Router(replicas, RouterConfig(pd_split=split))


async def test_vllm_prefill_then_decode_with_the_returned_kv_transfer_params():
    kv_store: dict = {}
    prefill_app = build_fake_vllm(ScriptedEngine(), engine_id="p0", kv_store=kv_store)
    decode_app = build_fake_vllm(ScriptedEngine(), engine_id="d0", kv_store=kv_store)
    async with serve_app(prefill_app) as (p_url, _), serve_app(decode_app) as (d_url, _):
        router = pd_router(OpenAICompletionsClient(p_url, "m"), OpenAICompletionsClient(d_url, "m"))
        try:
            deltas, tokens = await collect(router, make_request("a", PROMPT, max_tokens=5))
            assert tokens == PROMPT[:5]  # the decode side's whole output, as colocated
            (prefill_body,) = prefill_app.state.bodies
            assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
            assert prefill_body["stream"] is False and prefill_body["max_tokens"] == 1
            (decode_body,) = decode_app.state.bodies
            params = decode_body["kv_transfer_params"]
            assert params["do_remote_prefill"] and params["remote_engine_id"] == "p0"
            assert decode_body["max_tokens"] == 5 and decode_body["stream"] is True
            assert len(decode_app.state.remote_prefills) == 1
            assert deltas[-1].num_cached_tokens == len(PROMPT) - 1
            pd = (await router.stats())["pd"]
            assert pd["decisions"]["split"] == 1 and pd["last_pair"] == ["prefill", "decode"]
            # A short prompt stays on the decode replica.
            await collect(router, make_request("b", PROMPT[:20], max_tokens=2))
            assert len(prefill_app.state.bodies) == 1
            assert (await router.stats())["pd"]["decisions"]["short"] == 1
        finally:
            await router.aclose()


async def test_a_failed_prefill_leg_is_decoded_unsplit():
    decode_app = build_fake_vllm(ScriptedEngine())
    async with serve_app(decode_app) as (d_url, _):
        dead = OpenAICompletionsClient("http://127.0.0.1:1", "m")  # nothing listens there
        router = pd_router(dead, OpenAICompletionsClient(d_url, "m"))
        try:
            _, tokens = await collect(router, make_request("a", PROMPT, max_tokens=3))
            assert tokens == PROMPT[:3]
            assert "kv_transfer_params" not in decode_app.state.bodies[0]
            assert (await router.stats())["pd"]["num_prefill_failures"] == 1
        finally:
            await router.aclose()


async def test_the_fake_vllms_pd_protocol_round_trips_through_once_router():
    kv_store: dict = {}
    prefill_app = build_fake_vllm(ScriptedEngine(), engine_id="p0", kv_store=kv_store)
    decode_app = build_fake_vllm(ScriptedEngine(), engine_id="d0", kv_store=kv_store)
    async with serve_app(prefill_app) as (p_url, _), serve_app(decode_app) as (d_url, _):
        argv = ["--openai-url", d_url, "--prefill-openai-url", p_url, "--openai-model", "m",
                "--pd-min-uncached-tokens", "32", "--pd-min-decoding", "0",
                "--pd-ttft-budget", "1000"]  # fmt: skip
        router = build_router(build_parser().parse_args(argv))
        async with serve_app(build_engine_app(router, model_name="r")) as (router_url, _):
            client = RemoteEngineClient(router_url)
            try:
                _, tokens = await collect(client, make_request("a", PROMPT, max_tokens=4))
                assert tokens == PROMPT[:4]
                assert len(decode_app.state.remote_prefills) == 1
                assert (await client.stats())["pd"]["decisions"]["split"] == 1
                async with httpx.AsyncClient(base_url=router_url) as http:
                    text = (await http.get("/metrics")).text
                assert "pd_decisions_split 1.0" in text and "pd_pairs_" in text
            finally:
                await client.aclose()
                await router.aclose()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_once_engines_split_with_real_kv_transfer(tiny_model_dir, transport):
    def engine(**settings):
        config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64,
                              **settings)  # fmt: skip
        return AsyncEngine(LLMEngine(config))

    prompt = list(range(3, 42))  # 9 full blocks of 4, a tail of 2, the last token
    colocated = engine()
    _, expected = await collect(colocated, make_request("c", prompt, max_tokens=6))
    await colocated.close()
    prefill, decode = engine(role="prefill", kv_transfer=transport), engine(role="decode")
    replicas = [in_process_replica("p", prefill, index=0, role="prefill"),
                in_process_replica("d", decode, index=1, role="decode")]  # fmt: skip
    router = Router(replicas, RouterConfig(block_size=4, pd_split=EAGER))
    try:
        deltas, tokens = await collect(router, make_request("a", prompt, max_tokens=6))
        assert tokens == expected
        metrics = deltas[-1].metrics
        assert metrics.num_computed_tokens == 1 and metrics.num_cached_tokens == 38
        stats = await decode.stats()
        assert stats["kv_tier_transfer_hit_blocks"] == 9
    finally:
        await router.aclose()
        await prefill.close()
        await decode.close()
