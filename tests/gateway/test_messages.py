"""The Anthropic Messages API on the gateway, with the official `anthropic` SDK as client.

The reference for rendering is the Responses API on the same gateway: a conversation sent
as Messages must reach the engine as exactly the token ids of the same conversation sent
as Responses items. Objects are validated with the SDK's models; errors must take
Anthropic's shape, which the SDK turns into its typed exceptions.
"""

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message

from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "Bash",
        "description": "Run a command.",
        "parameters": TOOLS[0]["input_schema"],
        "strict": False,
    }
]
CALL = 'Let me look.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'


def client_for(url: str, api_key: str = "sk-test") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0, timeout=10)


async def test_a_message_reports_the_engine_cache_in_anthropic_usage(runtime):
    engine = scripted_texts(runtime, ["Hello!", "Hello!"])
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        messages = [{"role": "user", "content": "Hi"}]
        first = await client.messages.create(
            model=MODEL, max_tokens=64, system=system, messages=messages
        )
        Message.model_validate(first.model_dump())
        assert first.content[0].text == "Hello!" and first.stop_reason == "end_turn"
        prompt = len(engine.requests[0].prompt_token_ids)
        assert first.usage.input_tokens == prompt and first.usage.cache_read_input_tokens == 0
        again = await client.messages.create(
            model=MODEL, max_tokens=64, system=system, messages=messages
        )
        used = again.usage
        assert used.cache_read_input_tokens > 0
        assert used.input_tokens + used.cache_read_input_tokens == prompt
        assert used.cache_creation_input_tokens == 0


async def test_tool_use_round_trip_renders_as_the_responses_api_conversation(runtime):
    texts = [CALL, "Two files."]
    engine = scripted_texts(runtime, texts + texts)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        messages = [{"role": "user", "content": "What is here?"}]
        first = await client.messages.create(
            model=MODEL, max_tokens=200, system="Terse.", messages=messages, tools=TOOLS
        )
        assert first.stop_reason == "tool_use"
        text, tool_use = first.content
        assert text.text == "Let me look." and tool_use.input == {"command": "ls"}
        messages += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a b"}],
            },
        ]
        second = await client.messages.create(
            model=MODEL, max_tokens=200, system="Terse.", messages=messages, tools=TOOLS
        )
        assert second.content[0].text == "Two files."

        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=10) as http:
            items = [{"type": "message", "role": "user", "content": "What is here?"}]
            body = {"model": MODEL, "instructions": "Terse.", "tools": RESPONSES_TOOLS}
            reply = (await http.post("/responses", json={**body, "input": items})).json()
            items += reply["output"]
            call_id = reply["output"][-1]["call_id"]
            items.append({"type": "function_call_output", "call_id": call_id, "output": "a b"})
            await http.post("/responses", json={**body, "input": items})
    prompts = [list(r.prompt_token_ids) for r in engine.requests]
    assert prompts[0] == prompts[2] and prompts[1] == prompts[3]


async def test_the_stream_is_anthropics_event_sequence(runtime):
    engine = scripted_texts(runtime, [CALL, "Plain text."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        kinds = []
        async with client.messages.stream(
            model=MODEL,
            max_tokens=200,
            messages=[{"role": "user", "content": "list"}],
            tools=TOOLS,
        ) as stream:
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_message()
        raw = []
        body = {
            "model": MODEL,
            "max_tokens": 200,
            "stream": True,
            "messages": [{"role": "user", "content": "list"}],
        }
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with http.stream("POST", "/v1/messages", json=body) as response:
                raw = [line async for line in response.aiter_lines() if line.startswith("event:")]
    assert final.stop_reason == "tool_use" and final.content[1].input == {"command": "ls"}
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    raw_kinds = [line.split(": ", 1)[1] for line in raw]
    assert raw_kinds[:2] == ["message_start", "ping"]
    assert raw_kinds[-2:] == ["message_delta", "message_stop"]


async def test_stop_sequences_count_tokens_and_x_api_key(runtime, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-ant-test"\ntenant = "acme"\n')
    from once.gateway.config import GatewayConfig

    config = GatewayConfig(store="memory", api_keys_file=str(keys))
    engine = scripted_texts(runtime, ["alpha beta END gamma"])
    async with serve_gateway(runtime, engine, config) as (url, _):
        async with client_for(url, api_key="sk-ant-test") as client:
            message = await client.messages.create(
                model=MODEL,
                max_tokens=64,
                messages=[{"role": "user", "content": "go"}],
                stop_sequences=["END"],
            )
            assert message.content[0].text == "alpha beta "
            assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
            counted = await client.messages.count_tokens(
                model=MODEL, messages=[{"role": "user", "content": "go"}], tools=TOOLS
            )
            assert counted.input_tokens > 20
        async with client_for(url, api_key="sk-wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await client.messages.create(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "go"}]
                )
            assert denied.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "change, status, fragment",
    [
        ({"max_tokens": "5"}, 400, "max_tokens"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "claude-unknown"}, 404, "claude-unknown"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ({"temperature": "hot"}, 400, "temperature"),
    ],
)
async def test_refusals_take_anthropics_error_shape(runtime, change, status, fragment):
    engine = scripted_texts(runtime, ["fine"])
    async with serve_gateway(runtime, engine) as (url, _):
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            refused = await http.post("/v1/messages", json={**body, **change})
            assert refused.status_code == status
            error = refused.json()
            assert error["type"] == "error" and fragment in error["error"]["message"]
            assert (await http.post("/v1/messages", json=body)).status_code == 200
    assert json.loads(json.dumps(error))["error"]["type"] in (
        "invalid_request_error",
        "not_found_error",
    )
