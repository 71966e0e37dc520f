import contextlib

import httpx
import pytest

from once.engine.scripted import ScriptedEngine, scripted_logprobs
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams, TokenLogprob
from once.protocol.errors import EngineDeadError, InvalidRequestError, OnceError
from once.router import OpenAICompletionsClient, Router, RouterConfig
from once.router.openai_replica import error_from_status, logprobs_of, token_ids_of
from tests.router.fake_vllm import build_fake_vllm, serve_app
from tests.router.fakes import collect, make_request

PROMPT = list(range(10, 74))  # 4 blocks of 16


@pytest.mark.parametrize("id_mode", ["token_ids", "logprobs"])
async def test_streams_token_ids_and_reports_cached_tokens(id_mode):
    engine = ScriptedEngine(tokens_per_delta=2)
    app = build_fake_vllm(engine, id_mode=id_mode)
    async with serve_app(app) as (url, _):
        client = OpenAICompletionsClient(url, model="m")
        try:
            request = make_request("a", PROMPT, forced=None, max_tokens=5)
            deltas, tokens = await collect(client, request)
            assert tokens == PROMPT[:5]  # the scripted engine echoes the prompt
            assert deltas[-1].finish_reason == "length"
            assert deltas[-1].metrics.num_output_tokens == 5
            body = app.state.bodies[0]
            assert body["prompt"] == PROMPT and body["model"] == "m"
            assert body["max_tokens"] == 5 and body["stream"] is True
            assert body["return_token_ids"] is True and body["ignore_eos"] is True
            # Second identical prompt: the replica's prefix cache answers, usage says so.
            deltas, _ = await collect(client, make_request("b", PROMPT, max_tokens=5))
            assert deltas[-1].num_cached_tokens == 48
            assert (await client.stats())["num_cached_prompt_tokens"] == 48
            await client.check_health()
        finally:
            await client.aclose()


async def test_forced_outputs_and_salts_map_to_vllm_fields():
    engine = ScriptedEngine()
    app = build_fake_vllm(engine)
    async with serve_app(app) as (url, _):
        client = OpenAICompletionsClient(url, model="m")
        try:
            request = make_request("f", PROMPT, forced=[1, 2, 3], max_tokens=100)
            request = type(request)(**{**request.__dict__, "cache_salt": "tenant-a"})
            await collect(client, request)
            body = app.state.bodies[0]
            assert body["max_tokens"] == 3 and body["ignore_eos"] is True
            assert body["cache_salt"] == "tenant-a"
        finally:
            await client.aclose()


CONSTRAINTS = [
    (
        OutputConstraint("json_schema", '{"type": "object", "required": ["a"]}'),
        {"json": {"type": "object", "required": ["a"]}, "disable_any_whitespace": True},
    ),
    (OutputConstraint("json_object"), {"json_object": True, "disable_any_whitespace": True}),
    (OutputConstraint("lark", 'start: "yes" | "no"'), {"grammar": 'start: "yes" | "no"'}),
    (OutputConstraint("regex", "[0-9]{3}"), {"regex": "[0-9]{3}"}),
]


@pytest.mark.parametrize(("constraint", "expected"), CONSTRAINTS)
async def test_constraints_map_to_vllm_structured_outputs(constraint, expected):
    engine = ScriptedEngine()
    app = build_fake_vllm(engine)
    async with serve_app(app) as (url, _):
        client = OpenAICompletionsClient(url, model="m")
        try:
            sampling = SamplingParams(max_tokens=4, constraint=constraint)
            await collect(client, GenerateRequest("c", tuple(PROMPT), sampling))
            assert app.state.bodies[0]["structured_outputs"] == expected
            assert engine.requests[0].sampling.constraint == constraint  # mapped back
            forced = GenerateRequest("f", tuple(PROMPT), sampling, forced_output_ids=(5, 6))
            await collect(client, forced)
            assert "structured_outputs" not in app.state.bodies[1]  # forced ids bypass it
        finally:
            await client.aclose()


async def test_the_fake_vllm_rejects_two_constraints_at_once():
    engine = ScriptedEngine()
    app = build_fake_vllm(engine)
    async with serve_app(app) as (url, _), httpx.AsyncClient(base_url=url) as http:
        body = {
            "prompt": PROMPT,
            "max_tokens": 2,
            "structured_outputs": {"regex": "a", "grammar": "b"},
        }
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 400 and "exactly one" in response.text
        assert not engine.requests


@pytest.mark.parametrize("id_mode", ["token_ids", "logprobs"])
async def test_logprobs_map_to_vllm_and_back_to_ids(id_mode):
    engine = ScriptedEngine(tokens_per_delta=2)
    app = build_fake_vllm(engine, id_mode=id_mode)
    async with serve_app(app) as (url, _):
        client = OpenAICompletionsClient(url, model="m")
        try:
            sampling = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
            deltas, tokens = await collect(client, GenerateRequest("lp", tuple(PROMPT), sampling))
            body = app.state.bodies[0]
            assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] is True
            assert engine.requests[0].sampling.logprobs == 3  # the fake got k
            assert tokens == PROMPT[:5]
            for delta in deltas:
                assert delta.logprobs == (scripted_logprobs(delta.token_ids, 3) or None)
            plain, _ = await collect(client, make_request("p", PROMPT, max_tokens=2))
            assert "logprobs" not in app.state.bodies[1]
            assert "return_tokens_as_token_ids" not in app.state.bodies[1]
            assert all(d.logprobs is None for d in plain)
        finally:
            await client.aclose()


def test_vllm_logprobs_are_ordered_and_cut_to_k():
    # vLLM's top_logprobs: the sampled id first, then the top k; k + 1 keys when the
    # sampled id ranks below k. -inf arrives clamped to -9999.0 and is kept.
    choice = {
        "token_ids": [42, 7],
        "logprobs": {
            "tokens": ["token_id:42", "token_id:7"],
            "token_logprobs": [-3.5, -0.1],
            "top_logprobs": [
                {"token_id:42": -3.5, "token_id:5": -0.2, "token_id:9": -1.0},
                {"token_id:7": -0.1, "token_id:8": -9999.0},
            ],
        },
    }
    assert logprobs_of(choice, [42, 7], 2) == [
        TokenLogprob(42, -3.5, ((5, -0.2), (9, -1.0))),
        TokenLogprob(7, -0.1, ((7, -0.1), (8, -9999.0))),
    ]
    only_sampled = {"logprobs": {"token_logprobs": [-0.5], "top_logprobs": [{"token_id:3": -0.5}]}}
    assert logprobs_of(only_sampled, [3], 0) == [TokenLogprob(3, -0.5)]
    text_keys = {"logprobs": {"token_logprobs": [-0.5], "top_logprobs": [{"hi": -0.5}]}}
    with pytest.raises(OnceError, match="keyed by text"):
        logprobs_of(text_keys, [3], 1)
    with pytest.raises(OnceError, match="no logprob"):
        logprobs_of({"logprobs": {"token_logprobs": [-0.5]}}, [3, 4], 1)
    with pytest.raises(OnceError, match="no logprob"):
        logprobs_of({"token_ids": [3]}, [3], 1)


async def test_errors_from_the_server_are_mapped():
    engine = ScriptedEngine(max_model_len=32)
    app = build_fake_vllm(engine, id_mode="text")
    async with serve_app(app) as (url, _):
        client = OpenAICompletionsClient(url, model="m")
        try:
            with pytest.raises(InvalidRequestError, match="maximum context length"):
                await collect(client, make_request("long", PROMPT))
            with pytest.raises(OnceError, match="without token ids"):
                await collect(client, make_request("text", PROMPT[:8]))
        finally:
            await client.aclose()


def test_error_and_id_parsing_rules():
    assert isinstance(error_from_status(503, b"{}"), OnceError)
    assert error_from_status(503, b"busy").code == "engine_overloaded"
    assert error_from_status(500, b'{"message": "boom"}').code == "engine_unavailable"
    assert "boom" in error_from_status(500, b'{"message": "boom"}').message
    assert token_ids_of({"token_ids": [1, 2]}) == [1, 2]
    assert token_ids_of({"logprobs": {"tokens": ["token_id:7"]}}) == [7]
    assert token_ids_of({"text": "", "finish_reason": "stop"}) == []
    with pytest.raises(OnceError):
        token_ids_of({"logprobs": {"tokens": ["hello"]}})


async def test_router_fails_over_from_a_stopped_vllm_replica():
    engines = [ScriptedEngine(), ScriptedEngine()]
    stack0 = contextlib.AsyncExitStack()
    async with stack0, serve_app(build_fake_vllm(engines[1])) as (url1, _):
        url0, _ = await stack0.enter_async_context(serve_app(build_fake_vllm(engines[0])))
        clients = [OpenAICompletionsClient(url0, "m"), OpenAICompletionsClient(url1, "m")]
        router = Router.over(clients, RouterConfig(policy="round_robin"))
        try:
            _, tokens = await collect(router, make_request("a", PROMPT, max_tokens=3))
            assert tokens == PROMPT[:3] and len(engines[0].requests) == 1
            await stack0.aclose()  # replica 0 goes away
            for i in range(3):
                _, tokens = await collect(router, make_request(f"c{i}", PROMPT, max_tokens=2))
                assert tokens == PROMPT[:2]
            stats = await router.stats()
            assert stats["replicas"]["replica-0"]["healthy"] is False
            assert stats["num_finished"] == 4 and stats["num_retries"] == 1
            assert len(engines[1].requests) == 3
        finally:
            await router.aclose()
            for client in clients:
                await client.aclose()


async def test_health_check_of_an_unreachable_server_is_engine_dead():
    client = OpenAICompletionsClient("http://127.0.0.1:9", model="m")
    try:
        with pytest.raises(EngineDeadError):
            await client.check_health()
        with pytest.raises(EngineDeadError):
            await collect(client, make_request("x", PROMPT))
    finally:
        await client.aclose()
