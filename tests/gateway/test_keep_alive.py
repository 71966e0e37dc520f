"""Keep-alives while a response waits for its first token (issue 31).

A scripted engine whose first token takes `TTFT_S` stands for a long prefill; the gateway
sends a keep-alive every `INTERVAL_S` meanwhile. On the wire each API gets its own (a
repeated `response.in_progress`, an SSE comment, Anthropic's `ping`); through the official
SDKs the streams parse to what they were without them.
"""

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from once.gateway.config import GatewayConfig
from once.gateway.front.keep_alive import KEEP_ALIVE, with_keep_alives
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

TTFT_S = 1.5  # many intervals: even a starved event loop fires the timer once
INTERVAL_S = 0.05
TEXT = "Hello there."


def config(keep_alive_s: float = INTERVAL_S) -> GatewayConfig:
    return GatewayConfig(store="memory", keep_alive_s=keep_alive_s)


# -- the wrapper ---------------------------------------------------------------------------


async def test_keep_alives_come_only_between_items_and_until_the_next_one():
    release = asyncio.Event()

    async def source():
        yield "opening"
        await release.wait()  # released by the consumer: no timing window
        yield "first token"

    seen = []
    async for item in with_keep_alives(source(), 0.01):
        seen.append(item)
        if seen.count(KEEP_ALIVE) == 3:
            release.set()
    assert seen[0] == "opening" and seen[-1] == "first token"
    assert seen[1:-1] == [KEEP_ALIVE] * (len(seen) - 2) and len(seen) >= 5


async def test_closing_while_waiting_runs_the_source_finally():
    closed = asyncio.Event()

    async def source():
        try:
            yield "opening"
            await asyncio.Event().wait()  # never: a prefill that does not end
        finally:
            closed.set()

    stream = with_keep_alives(source(), 0.01)
    assert await anext(stream) == "opening"
    assert await anext(stream) is KEEP_ALIVE
    await stream.aclose()
    await asyncio.wait_for(closed.wait(), 30)


# -- Responses: SSE and WebSocket -----------------------------------------------------------


async def sse_events(url: str, path: str, body: dict, headers: dict | None = None) -> list[str]:
    """The raw SSE blocks of one streamed request."""
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url + path, json=body, headers=headers) as reply:
            assert reply.status_code == 200
            raw = (await reply.aread()).decode()
    return [block for block in raw.split("\n\n") if block]


async def test_responses_sse_repeats_in_progress_while_the_first_token_waits(runtime):
    engine = scripted_texts(runtime, [TEXT], ttft_s=TTFT_S)
    async with serve_gateway(runtime, engine, config()) as (url, _):
        body = {"model": MODEL, "input": "Hi", "stream": True}
        blocks = await sse_events(url, "/v1/responses", body)
    events = [json.loads(block.split("data: ", 1)[1]) for block in blocks]
    types = [event["type"] for event in events]
    first_delta = types.index("response.output_text.delta")
    assert types[:2] == ["response.created", "response.in_progress"]
    waiting = types[2:first_delta]
    assert waiting.count("response.in_progress") >= 2, types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["response"]["status"] == "in_progress" for e in events[1:first_delta]
               if e["type"] == "response.in_progress")  # fmt: skip


async def test_a_read_timeout_shorter_than_the_prefill_is_kept_alive(runtime):
    # The client's read timeout (0.5 s) is shorter than the wait for the first token: with
    # keep-alives the stream completes; without, the SDK times out, as `make run` did.
    timeout = openai.Timeout(10, read=0.5)
    for keep_alive_s, survives in ((INTERVAL_S, True), (0, False)):
        engine = scripted_texts(runtime, [TEXT], ttft_s=TTFT_S)
        async with serve_gateway(runtime, engine, config(keep_alive_s)) as (url, _):
            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=timeout
            )
            async with client:
                if survives:
                    stream = await client.responses.create(model=MODEL, input="Hi", stream=True)
                    events = [event async for event in stream]
                    assert events[-1].type == "response.completed"
                    assert events[-1].response.output_text == TEXT
                else:
                    with pytest.raises(openai.APITimeoutError):
                        stream = await client.responses.create(model=MODEL, input="Hi", stream=True)
                        _ = [event async for event in stream]


async def test_websocket_frames_keep_alive_and_the_sdk_still_completes(runtime):
    engine = scripted_texts(runtime, [TEXT], ttft_s=TTFT_S)
    async with serve_gateway(runtime, engine, config()) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        async with client, client.responses.connect() as connection:
            await connection.response.create(model=MODEL, input="Hi", store=False)
            types = []
            async for event in connection:
                types.append(event.type)
                if event.type == "response.completed":
                    assert event.response.output_text == TEXT
                    break
    first_delta = types.index("response.output_text.delta")
    assert types[:first_delta].count("response.in_progress") >= 3, types


# -- Chat Completions and Messages ----------------------------------------------------------


async def test_chat_sse_sends_comments_the_sdk_never_sees(runtime):
    chunks_by_setting = {}
    for keep_alive_s in (INTERVAL_S, 0):
        engine = scripted_texts(runtime, [TEXT, TEXT], ttft_s=TTFT_S)
        async with serve_gateway(runtime, engine, config(keep_alive_s)) as (url, _):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            blocks = await sse_events(url, "/v1/chat/completions", {**body, "stream": True})
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
            async with client:
                stream = await client.chat.completions.create(**body, stream=True)
                chunks = [chunk async for chunk in stream]
        comments = [block for block in blocks if block.startswith(":")]
        assert (len(comments) >= 2) == (keep_alive_s > 0), blocks
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == TEXT
        chunks_by_setting[keep_alive_s] = _without_text(chunks)
    assert chunks_by_setting[INTERVAL_S] == chunks_by_setting[0]


def _without_text(chunks) -> list[dict]:
    """The chunks less their text (compared whole above), repeats merged: deltas that are
    ready together go out as one chunk, so a busy machine splits the text differently."""
    shapes: list[dict] = []
    for chunk in chunks:
        shape = chunk.model_dump(exclude={"id", "created"})
        for choice in shape["choices"]:
            choice["delta"].pop("content", None)
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return shapes


async def test_messages_sse_pings_and_the_anthropic_sdk_parses_the_same_message(runtime):
    engine = scripted_texts(runtime, [TEXT, TEXT], ttft_s=TTFT_S)
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    async with serve_gateway(runtime, engine, config()) as (url, _):
        blocks = await sse_events(url, "/v1/messages", {**body, "stream": True})
        client = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        async with client, client.messages.stream(**body) as stream:
            kinds = [event.type async for event in stream]
            message = await stream.get_final_message()
    names = [block.split("\n", 1)[0] for block in blocks]
    first_delta = names.index("event: content_block_delta")
    assert names[:first_delta].count("event: ping") >= 3, names
    assert message.content[0].text == TEXT and message.stop_reason == "end_turn"
    assert "ping" not in kinds  # the SDK's high-level stream drops them


async def test_keep_alives_between_output_tokens_leave_the_sdk_accumulator_whole(runtime):
    # A stall mid-output (a slow decode step, a hosted tool) gets keep-alives too; the
    # SDK's `responses.stream()` folds each `response.in_progress` snapshot into its own.
    engine = scripted_texts(runtime, [TEXT], token_latency_s=0.3)
    async with serve_gateway(runtime, engine, config()) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        async with client, client.responses.stream(model=MODEL, input="Hi") as stream:
            types = [event.type async for event in stream]
            final = await stream.get_final_response()
    first_delta = types.index("response.output_text.delta")
    assert "response.in_progress" in types[first_delta:], types
    assert final.output_text == TEXT and final.status == "completed"
