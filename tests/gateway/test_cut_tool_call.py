"""A forced tool call cut off by the output limit leaves no `<tool_call>` markup in the
text (issue 33): the response ends incomplete / `length`, and its content is what the
model wrote before the call, not the call's half-written tags and JSON."""

import httpx

from once.gateway.config import GatewayConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

CALL = (
    '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls -la /tmp && echo done"}}\n</tool_call>'
)
SHELL = {
    "name": "shell",
    "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}


async def test_chat_and_responses_show_no_markup_of_a_cut_call(runtime):
    engine = scripted_texts(runtime, [CALL, CALL])
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "list"}],
        "tools": [{"type": "function", "function": SHELL}],
        "tool_choice": "required",
        "max_tokens": 6,
    }
    responses = {
        "model": MODEL,
        "input": "list",
        "tools": [{"type": "function", **SHELL}],
        "tool_choice": "required",
        "max_output_tokens": 6,
    }
    async with serve_gateway(runtime, engine, GatewayConfig(store="memory")) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            completion = (await http.post("/v1/chat/completions", json=chat)).json()
            response = (await http.post("/v1/responses", json=responses)).json()
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    texts = [
        part.get("text", "")
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    ]
    assert not any("<tool_call>" in text for text in texts)
