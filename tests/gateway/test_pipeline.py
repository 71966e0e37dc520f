"""The response pipeline's own bookkeeping: done once per response, whatever the transport.

Each test drives the real gateway with the `openai` SDK (HTTP JSON, SSE and WebSocket
mode) around a scripted engine and reads the gateway's Prometheus metrics.
"""

import asyncio
import time

import httpx
import openai
import pytest

from once.gateway.config import GatewayConfig
from once.gateway.output import (
    ItemEmitted,
    MessageClosed,
    MessageOpened,
    OutputBuilder,
    OutputTextDelta,
    ResponseFinished,
    ResponseStarted,
    Usage,
)
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)


def histogram(gateway) -> tuple[float, float]:
    """(count, sum) of the added-time histogram."""
    count = total = 0.0
    for family in gateway.metrics.added_seconds.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total


async def one_of_each_transport(client) -> None:
    assert (await client.responses.create(model=MODEL, input="json")).output_text == "A."
    stream = await client.responses.create(model=MODEL, input="sse", stream=True)
    assert [e.type async for e in stream][-1] == "response.completed"
    async with client.responses.connect() as connection:
        await connection.response.create(model=MODEL, input="ws")
        async for event in connection:
            if event.type == "response.completed":
                break


async def test_every_transport_is_counted_once_with_its_outcome(runtime):
    engine = scripted_texts(runtime, ["A.", "B.", "C."])
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        await one_of_each_transport(client)
        await asyncio.sleep(0)  # the WebSocket handler's finally runs after its last send
        metrics = gateway.metrics
        assert metrics.value(metrics.requests, "http", "response.completed") == 2
        for _ in range(100):
            if metrics.value(metrics.requests, "websocket", "response.completed") == 1:
                break
            await asyncio.sleep(0.01)
        assert metrics.value(metrics.requests, "websocket", "response.completed") == 1
        assert metrics.value(metrics.inflight) == 0
        count, total = histogram(gateway)
        assert count == 3 and total > 0
        for stage in ("admit", "prepare", "events", "writes"):
            assert metrics.value(metrics.added_stage_seconds, stage) > 0, stage


async def test_a_refused_request_is_counted_once_as_an_error(runtime):
    engine = scripted_texts(runtime, [])
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model=MODEL, input="x", temperature=7)
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_no")
        metrics = gateway.metrics
        assert metrics.value(metrics.requests, "http", "error") == 2
        assert histogram(gateway)[0] == 0  # nothing was streamed
    assert engine.requests == []


async def test_the_added_time_leaves_out_the_wait_for_the_engine(runtime):
    ttft_s = 0.5
    engine = scripted_texts(runtime, ["Slow to start."], ttft_s=ttft_s)
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        started = time.perf_counter()
        stream = await client.responses.create(model=MODEL, input="go", stream=True)
        assert [e.type async for e in stream][-1] == "response.completed"
        elapsed = time.perf_counter() - started
    count, added_s = histogram(gateway)
    assert count == 1
    # The engine's half second is inside the client's time and outside the gateway's own.
    assert 0 < added_s <= elapsed - ttft_s


def test_output_events_come_in_order_with_copies_of_the_items():
    output = OutputBuilder("resp_1", 7)
    events = output.started() + output.text("Let me ") + output.text("look.")
    events += output.function_call("shell", '{"cmd":"ls"}')
    events += output.finish("completed", Usage(10, 4, 3))
    kinds = [type(event) for event in events]
    assert kinds == [
        ResponseStarted,
        MessageOpened,
        OutputTextDelta,
        OutputTextDelta,
        MessageClosed,
        ItemEmitted,
        ResponseFinished,
    ]
    opened, closed, call = events[1], events[4], events[5]
    assert opened.item["content"] == [] and opened.item["status"] == "in_progress"
    assert closed.item["content"][0]["text"] == "Let me look."
    assert closed.item["status"] == "completed" and closed.output_index == 0
    assert call.output_index == 1 and call.item["name"] == "shell"
    assert [item["type"] for item in output.items] == ["message", "function_call"]
    output.items[0]["content"][0]["text"] = "changed later"
    assert closed.item["content"][0]["text"] == "Let me look."  # the event kept its copy
    assert events[-1].usage.total_tokens == 13


async def test_a_request_without_an_output_budget_gets_the_servers_default(runtime):
    engine = scripted_texts(runtime, ["ok"] * 3)
    config = GatewayConfig(store="memory", default_max_output_tokens=40)
    async with serve_gateway(runtime, engine, config) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for budget in (None, 7, 400):
                body = {"model": MODEL, "input": "hi"}
                if budget is not None:
                    body["max_output_tokens"] = budget
                assert (await http.post("/v1/responses", json=body)).status_code == 200
    asked = [request.sampling.max_tokens for request in engine.requests]
    assert asked == [40, 7, 400]  # the default only where the client set none


async def test_response_logprobs_have_the_sdks_shape(runtime):
    # The output part's logprobs need each token's bytes (the SDK's `Logprob`); the delta
    # event's carry none: both parse as the SDK's types.
    from openai.types.responses import Response, ResponseTextDeltaEvent

    engine = scripted_texts(runtime, ["ok then"] * 2)
    async with serve_gateway(runtime, engine, GatewayConfig(store="memory")) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        asks = {"top_logprobs": 2, "include": ["message.output_text.logprobs"]}
        response = await client.responses.create(model=MODEL, input="hi", **asks)
        stream = await client.responses.create(model=MODEL, input="hi", stream=True, **asks)
        deltas = [event async for event in stream if event.type == "response.output_text.delta"]
    part = Response.model_validate(response.model_dump()).output[0].content[0]
    assert part.logprobs and all(lp.bytes == list(lp.token.encode()) for lp in part.logprobs)
    assert deltas and all(isinstance(event, ResponseTextDeltaEvent) for event in deltas)
    assert all(event.logprobs for event in deltas)
