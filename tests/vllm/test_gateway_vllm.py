"""The gateway over a live vLLM server (`once serve --openai-url`): every API, streaming,
stop sequences, structured outputs and forced tool calls (vLLM's llguidance), logprobs,
cached tokens from vLLM's usage, aborts when the client leaves, and prompts that vLLM
never tokenizes (the tokenizer-less server serves them)."""

import asyncio
import json
import time
from dataclasses import replace

import anthropic
import httpx
import openai
import pytest

from once.gateway.config import GatewayConfig
from once.gateway.testing import load_runtime, serve_gateway
from once.router.openai_replica import OpenAICompletionsClient
from tests.vllm.conftest import MODEL

CONFIG = GatewayConfig(store="memory", verify_every=1, max_model_len=4096)
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def runtime():
    return replace(load_runtime(MODEL), max_model_len=4096)


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=None)


async def metrics_of(server) -> dict:
    metrics = await server.metrics()
    return {"prompt": metrics.prompt_tokens, "generated": metrics.generation_tokens,
            "running": metrics.num_running}  # fmt: skip


async def test_responses_websocket_chain_reuses_vllms_cache(vllm_pair, runtime):
    engine = OpenAICompletionsClient(vllm_pair[0].url, MODEL)
    async with serve_gateway(runtime, engine, CONFIG) as (url, gateway):
        client = openai_client(url)
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL, input="Name a fruit.", max_output_tokens=8, store=False
            )
            first = await _completed(connection)
            await connection.response.create(
                previous_response_id=first.id,
                input=[{"role": "user", "content": "And a vegetable?"}],
                max_output_tokens=8,
            )
            second = await _completed(connection)
        assert {first.status, second.status} <= {"completed", "incomplete"}
        assert second.usage.input_tokens > first.usage.input_tokens
        # vLLM's own usage: the chain's prefix was in its cache (32-token blocks).
        assert second.usage.input_tokens_details.cached_tokens >= 32
        await client.close()
    await engine.aclose()


async def _completed(connection):
    async for event in connection:
        if event.type in ("response.completed", "response.incomplete"):
            return event.response  # incomplete: max_output_tokens reached, as asked
        assert event.type not in ("error", "response.failed"), event


async def test_chat_stream_stop_and_logprobs_and_messages(vllm_pair, runtime):
    engine = OpenAICompletionsClient(vllm_pair[0].url, MODEL)
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        client = openai_client(url)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count from one to ten, comma separated."}],
            max_tokens=40,
            stop=[","],
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "," not in text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "stop"
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
        assert entries and all(len(e.top_logprobs) == 2 for e in entries)
        assert all(e.logprob <= 0 for e in entries)
        await client.close()

        messages = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, timeout=None)
        reply = await messages.messages.create(
            model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Hello!"}]
        )
        assert reply.content[0].type == "text" and reply.usage.output_tokens >= 1
        await messages.close()
    await engine.aclose()


async def test_structured_outputs_and_forced_tool_calls_follow_vllms_grammar(vllm_pair, runtime):
    engine = OpenAICompletionsClient(vllm_pair[0].url, MODEL)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}  # fmt: skip
    # strict: the arguments follow the schema (without it, any JSON object, as OpenAI's).
    tool = {"type": "function", "function": {"name": "pick", "strict": True, "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
        "required": ["color"], "additionalProperties": False}}}  # fmt: skip
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        client = openai_client(url)
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is water wet?"}],
            max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        assert json.loads(reply.choices[0].message.content)["ok"] in (True, False)
        called = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Pick a color."}],
            max_tokens=60,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "pick"}},
        )
        call = called.choices[0].message.tool_calls[0]
        assert call.function.name == "pick"
        assert json.loads(call.function.arguments)["color"] in ("red", "blue")
        await client.close()
    await engine.aclose()


async def test_vllm_stops_decoding_when_the_client_goes_away(vllm_pair, runtime):
    server = vllm_pair[0]
    engine = OpenAICompletionsClient(server.url, MODEL)
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        before = await metrics_of(server)
        body = {"model": MODEL, "input": "Write a very long story.", "max_output_tokens": 3000,
                "stream": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=None) as http:
            async with http.stream("POST", f"{url}/v1/responses", json=body) as reply:
                async for line in reply.aiter_lines():
                    if "output_text.delta" in line:
                        break  # the client leaves mid-stream
        deadline = time.monotonic() + DEADLINE_S
        while (now := await metrics_of(server))["running"]:
            assert time.monotonic() < deadline, "vLLM still runs the abandoned request"
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        after = await metrics_of(server)
        assert after["generated"] == now["generated"]  # nothing more was decoded
        assert after["generated"] - before["generated"] < 3000
    await engine.aclose()


async def test_vllm_never_tokenizes_what_the_gateway_sends(vllm_pair, runtime):
    """vllm-1 runs with --skip-tokenizer-init: it holds no tokenizer, so every prompt it
    serves arrived as ids. Its prompt-token counter equals the gateway's own count."""
    server = vllm_pair[1]
    engine = OpenAICompletionsClient(server.url, MODEL)
    async with serve_gateway(runtime, engine, CONFIG) as (url, gateway):
        before = await metrics_of(server)
        client = openai_client(url)
        response = await client.responses.create(
            model=MODEL, input="Say hi.", max_output_tokens=6, store=False
        )
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6
        )
        await client.close()
        assert response.status in ("completed", "incomplete")  # incomplete: 6 tokens reached
        assert chat.choices[0].message.content is not None
        after = await metrics_of(server)
        sent = response.usage.input_tokens + chat.usage.prompt_tokens
        assert after["prompt"] - before["prompt"] == sent
    await engine.aclose()
