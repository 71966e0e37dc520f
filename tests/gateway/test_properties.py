"""Hypothesis properties of the gateway's request and event types.

- a request body valid by the gateway's own schema gets a 2xx, or a 4xx whose error names
  its code and the param at fault;
- a Responses event stream opens with `response.created`, numbers its events 0, 1, ...,
  closes every item it opens in order, carries in its deltas exactly the text of its
  `done` events and final response, and ends with one terminal event; every event is the
  SDK's type;
- a Messages stream follows Anthropic's order (message_start, ping, blocks started,
  filled and stopped by index, message_delta, message_stop) and its deltas are the
  message's text;
- Chat Completions' chunks add up to the non-streaming completion;
- the input items of a stored response list back what was sent, in any page size.

Each example runs against a fresh gateway (ASGI in process) whose ScriptedEngine answers
with the drawn text; examples are derandomized, so every run draws the same ones.
"""

import asyncio
import json
import re

import httpx
import pytest
import schemathesis
from anthropic.types import RawMessageStreamEvent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from once.gateway.app import build_gateway_app, create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.front.openapi import openapi_document
from once.gateway.testing import offline_hosted, scripted_texts
from tests.gateway.conftest import MODEL

CONFIG = GatewayConfig(store="memory", verify_every=1)
PROPERTY = settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)

# Text a model may write: any characters, a tool call now and then.
texts = st.text(st.characters(codec="utf-8"), max_size=60)


def tool_call(command: str) -> str:
    call = json.dumps({"name": "shell", "arguments": {"cmd": command}}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


tool_calls = texts.map(tool_call)
outputs = st.one_of(texts.filter(lambda text: "<tool_call>" not in text), tool_calls)
SHELL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    "strict": False,
}


async def _exchange(runtime, script: list[str], requests: list[tuple[str, str, dict | None]]):
    engine = scripted_texts(runtime, script)
    gateway = create_gateway(CONFIG, engine, {runtime.name: runtime}, hosted=offline_hosted())
    transport = httpx.ASGITransport(app=build_gateway_app(gateway))
    answers = []
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as c:
            for method, path, body in requests:
                answers.append(await c.request(method, path, json=body))
    finally:
        await gateway.close()
    return answers


def exchange(runtime, script, *requests):
    """Send `requests` (method, path, body) to a fresh gateway playing `script`."""
    return asyncio.run(_exchange(runtime, list(script), list(requests)))


def sse_events(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            events.append(json.loads(data[0]))
    return events


# -- any valid request ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def create_operation(runtime):
    engine = scripted_texts(runtime, [])
    gateway = create_gateway(CONFIG, engine, {runtime.name: runtime})
    document = openapi_document(build_gateway_app(gateway), auth=False, models=[runtime.name])
    return schemathesis.openapi.from_dict(document)["/v1/responses"]["POST"]


@PROPERTY
@given(data=st.data(), output=outputs)
def test_a_valid_request_is_answered_or_refused_by_name(runtime, create_operation, data, output):
    body = {**data.draw(create_operation.as_strategy()).body, "model": MODEL}
    [answer] = exchange(runtime, [output], ("POST", "/v1/responses", body))
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, answer.text
    if answer.status_code != 200:
        error = answer.json()["error"]
        assert error["code"] and isinstance(error["code"], str)
        assert error["param"], error  # a valid body is refused for one of its fields
    elif body.get("stream"):
        assert sse_events(answer)[-1]["type"] in TERMINAL
    else:
        Response.model_validate(answer.json())


# -- the Responses stream ----------------------------------------------------------------------


def check_response_stream(events: list[dict]) -> None:
    for event in events:
        STREAM_EVENT.validate_python(event)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert kinds[-1] in TERMINAL and not TERMINAL & set(kinds[:-1])
    added = [event for event in events if event["type"] == "response.output_item.added"]
    done = [event for event in events if event["type"] == "response.output_item.done"]
    assert [event["output_index"] for event in added] == list(range(len(added)))
    assert [event["output_index"] for event in done] == list(range(len(added)))
    assert [event["item"]["id"] for event in done] == [event["item"]["id"] for event in added]
    final = events[-1]["response"]
    assert final["output"] == [event["item"] for event in done]
    for item in final["output"]:
        if item["type"] != "message":
            continue
        deltas = "".join(
            event["delta"]
            for event in events
            if event["type"] == "response.output_text.delta" and event["item_id"] == item["id"]
        )
        [text_done] = [
            event
            for event in events
            if event["type"] == "response.output_text.done" and event["item_id"] == item["id"]
        ]
        assert deltas == text_done["text"] == item["content"][0]["text"]


@PROPERTY
@given(
    prompt=texts,
    output=outputs,
    max_output_tokens=st.none() | st.integers(1, 12),
    with_tools=st.booleans(),
)
def test_a_responses_stream_keeps_its_invariants(
    runtime, prompt, output, max_output_tokens, with_tools
):
    body = {"model": MODEL, "input": prompt or "hi", "stream": True}
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    if with_tools:
        body["tools"] = [SHELL]
    streamed, whole = exchange(
        runtime,
        [output, output],
        ("POST", "/v1/responses", body),
        ("POST", "/v1/responses", {**body, "stream": False}),
    )
    events = sse_events(streamed)
    check_response_stream(events)
    final, response = events[-1]["response"], Response.model_validate(whole.json())
    assert final["status"] == response.status
    assert [item["type"] for item in final["output"]] == [item.type for item in response.output]
    if final["status"] == "incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}


# -- the Messages stream -----------------------------------------------------------------------

MESSAGES_ORDER = re.compile(
    r"message_start ping (content_block_start (content_block_delta )*content_block_stop )*"
    r"message_delta message_stop"
)


@PROPERTY
@given(prompt=texts, output=outputs, max_tokens=st.integers(1, 40), with_tools=st.booleans())
def test_a_messages_stream_is_in_anthropics_order(runtime, prompt, output, max_tokens, with_tools):
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": prompt or "hi"}],
    }
    if with_tools:
        body["tools"] = [{"name": "shell", "input_schema": SHELL["parameters"]}]
    streamed, whole = exchange(
        runtime,
        [output, output],
        ("POST", "/v1/messages", body),
        ("POST", "/v1/messages", {**body, "stream": False}),
    )
    events = sse_events(streamed)
    assert MESSAGES_ORDER.fullmatch(" ".join(event["type"] for event in events))
    for event in events:
        if event["type"] != "ping":
            MESSAGE_EVENT.validate_python(event)
    starts = [event for event in events if event["type"] == "content_block_start"]
    assert [event["index"] for event in starts] == list(range(len(starts)))
    message = whole.json()
    assert len(message["content"]) == len(starts)
    for block, start in zip(message["content"], starts, strict=True):
        assert block["type"] == start["content_block"]["type"]
        if block["type"] == "text":
            deltas = [
                event["delta"]["text"]
                for event in events
                if event["type"] == "content_block_delta" and event["index"] == start["index"]
            ]
            assert "".join(deltas) == block["text"]
    assert events[-2]["delta"]["stop_reason"] == message["stop_reason"]


# -- Chat Completions --------------------------------------------------------------------------


@PROPERTY
@given(prompt=texts, output=outputs, max_tokens=st.none() | st.integers(1, 12))
def test_chat_chunks_add_up_to_the_completion(runtime, prompt, output, max_tokens):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt or "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    streamed, whole = exchange(
        runtime,
        [output, output],
        ("POST", "/v1/chat/completions", {**body, "stream": True}),
        ("POST", "/v1/chat/completions", body),
    )
    chunks = sse_events(streamed)
    assert streamed.text.endswith("data: [DONE]\n\n")
    completion = ChatCompletion.model_validate(whole.json())
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert content == (completion.choices[0].message.content or "")
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    assert reasons[-1] == completion.choices[0].finish_reason
    assert all(reason is None for reason in reasons[:-1])


# -- input items round trip --------------------------------------------------------------------

call_ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=4, max_size=12)
messages = st.builds(
    lambda role, text: {"role": role, "content": text or "."},
    st.sampled_from(["user", "assistant", "system", "developer"]),
    texts,
)
calls = st.builds(
    lambda call_id, command, result: [
        {
            "type": "function_call",
            "call_id": f"call_{call_id}",
            "name": "shell",
            "arguments": json.dumps({"cmd": command}),
        },
        {"type": "function_call_output", "call_id": f"call_{call_id}", "output": result},
    ],
    call_ids,
    texts,
    texts,
)
conversations = st.lists(messages.map(lambda m: [m]) | calls, min_size=1, max_size=6).map(
    lambda turns: [item for turn in turns for item in turn] + [{"role": "user", "content": "go"}]
)


@PROPERTY
@given(items=conversations, page_size=st.integers(1, 5))
def test_input_items_list_back_what_was_sent(runtime, items, page_size):
    listed = list_items(runtime, items, page_size)
    assert len(listed) == len(items)
    assert len({item["id"] for item in listed}) == len(items)
    for sent, got in zip(items, listed, strict=True):
        assert got["type"] == sent.get("type", "message") and got["status"]
        if got["type"] == "message":
            assert got["role"] == sent["role"]
            assert [part["text"] for part in got["content"]] == [sent["content"]]
        else:
            assert {key: got[key] for key in sent} == sent


def list_items(runtime, items: list[dict], page_size: int) -> list[dict]:
    """Store a response of `items`, then page through its input items, oldest first."""

    async def go():
        engine = scripted_texts(runtime, ["done"])
        gateway = create_gateway(CONFIG, engine, {runtime.name: runtime}, hosted=offline_hosted())
        transport = httpx.ASGITransport(app=build_gateway_app(gateway))
        listed: list[dict] = []
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                body = {"model": MODEL, "input": items, "tools": [SHELL]}
                created = await client.post("/v1/responses", json=body)
                assert created.status_code == 200, created.text
                path = f"/v1/responses/{created.json()['id']}/input_items"
                query: dict = {"order": "asc", "limit": page_size}
                while True:
                    page = await client.get(path, params=query)
                    assert page.status_code == 200, page.text
                    ResponseItemList.model_validate(page.json())
                    listed += page.json()["data"]
                    if not page.json()["has_more"]:
                        return listed
                    query["after"] = page.json()["last_id"]
        finally:
            await gateway.close()

    return asyncio.run(go())
