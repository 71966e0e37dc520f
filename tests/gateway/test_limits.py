"""Output limits: a default where the request sets none, and refusals naming the param.

Issue 33: a request without a limit ran toward the end of the context; Chat's
`max_tokens: 0` was refused as `max_output_tokens`; `max_tokens: 10**12` was accepted
where OpenAI and Anthropic refuse a limit above the model's maximum output.
"""

import httpx
import pytest

from once.gateway.config import DEFAULT_MAX_OUTPUT_TOKENS, GatewayConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

CONFIG = GatewayConfig(store="memory")
USER = [{"role": "user", "content": "hi"}]
HUGE = 10**12


async def test_a_request_without_a_limit_gets_the_default(runtime):
    assert DEFAULT_MAX_OUTPUT_TOKENS == 4096 == GatewayConfig().default_max_output_tokens
    engine = scripted_texts(runtime, ["ok"] * 2)
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": MODEL, "input": "hi"}
            assert (await http.post("/v1/responses", json=body)).status_code == 200
            body = {"model": MODEL, "messages": USER}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    # The context (8192) leaves more room than that: the default is what cut it.
    assert [r.sampling.max_tokens for r in engine.requests] == [4096, 4096]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0},
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": HUGE}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": HUGE},
         "max_completion_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": HUGE}, "max_output_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 8193}, "max_output_tokens"),
    ],
)  # fmt: skip
async def test_a_limit_out_of_range_is_refused_naming_the_param(runtime, path, body, param):
    engine = scripted_texts(runtime, [])
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            reply = await http.post(path, json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert not engine.requests


async def test_messages_refuses_a_max_tokens_above_the_context(runtime):
    engine = scripted_texts(runtime, [])
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": MODEL, "messages": USER, "max_tokens": HUGE}
            reply = await http.post("/v1/messages", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("max_tokens is too large")


async def test_a_limit_within_the_context_is_cut_to_the_room_left(runtime):
    engine = scripted_texts(runtime, ["ok"])
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": 8192}
            assert (await http.post("/v1/responses", json=body)).status_code == 200
    prompt = len(engine.requests[0].prompt_token_ids)
    assert engine.requests[0].sampling.max_tokens == 8192 - prompt
