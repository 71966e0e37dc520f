"""Requests the real APIs refuse get a 400 naming the param at fault (issue 33, item 6).

- a Messages content block of an unknown type names its `type` (it was reported as a
  missing `tool_use_id`, the last candidate of the SDK's union);
- a tool's output that answers no earlier call: Chat's `tool` message, Messages'
  `tool_result`, the Responses API's `function_call_output` in a whole conversation.
"""

import httpx
import pytest

from once.gateway.config import GatewayConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

CONFIG = GatewayConfig(store="memory")
CHAT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ],
}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def tool_result(tool_use_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "done"}


CASES = {
    "messages-bogus-block": (
        "/v1/messages",
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
        "messages[0].content[0].type",
    ),
    "messages-text-block-without-text": (
        "/v1/messages",
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    "messages-unknown-tool-use-id": (
        "/v1/messages",
        {"max_tokens": 5, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [TOOL_USE]},
            {"role": "user", "content": [tool_result("toolu_2")]},
        ]},
        "messages[2].content[0].tool_use_id",
    ),
    "chat-unknown-tool-call-id": (
        "/v1/chat/completions",
        {"messages": [
            {"role": "user", "content": "go"},
            CHAT_CALL,
            {"role": "tool", "tool_call_id": "call_2", "content": "done"},
        ]},
        "messages[2].tool_call_id",
    ),
    "chat-tool-message-before-any-call": (
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "done"}]},
        "messages[0].tool_call_id",
    ),
    "responses-unknown-call-id": (
        "/v1/responses",
        {"input": [
            {"type": "message", "role": "user", "content": "go"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_2", "output": "done"},
        ]},
        "input[2].call_id",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
async def test_refused_naming_the_param(runtime, case):
    path, body, param = CASES[case]
    engine = scripted_texts(runtime, [])
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            reply = await http.post(path, json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if path == "/v1/messages":  # Anthropic's error shape names no param: the message does
        assert param in error["message"] or param.rsplit(".", 1)[-1] in error["message"]
        assert "tool_use_id" not in error["message"] or "tool_use_id" in param
    else:
        assert error["param"] == param
    assert not engine.requests


async def test_answered_calls_still_pass(runtime):
    engine = scripted_texts(runtime, ["ok"] * 3)
    bodies = {
        "/v1/messages": {"max_tokens": 5, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [TOOL_USE]},
            {"role": "user", "content": [tool_result("toolu_1")]},
        ]},
        "/v1/chat/completions": {"messages": [
            {"role": "user", "content": "go"},
            CHAT_CALL,
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ]},
        "/v1/responses": {"input": [
            {"type": "message", "role": "user", "content": "go"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        ]},
    }  # fmt: skip
    async with serve_gateway(runtime, engine, CONFIG) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for path, body in bodies.items():
                reply = await http.post(path, json={"model": MODEL, **body})
                assert reply.status_code == 200, (path, reply.text)
