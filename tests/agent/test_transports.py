"""The transports on the wire: the agent loop against the real gateway, a scripted model.

The loop's own logic is tested on the in-memory ScriptedTransport in test_loop.py.
"""

import asyncio
import json

import anthropic
import openai
import pytest

from once.agent.loop import Agent, AgentConfig
from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.registry import ToolRegistry
from once.agent.transport.base import Transport, TransportError
from once.agent.transport.chat import ChatCompletionsTransport
from once.agent.transport.fake import ScriptedTransport
from once.agent.transport.http import HttpTransport
from once.agent.transport.messages import MessagesTransport
from once.agent.transport.websocket import WebSocketTransport
from once.gateway.testing import DEFAULT_MODEL, scripted_texts, serve_gateway

MODEL = DEFAULT_MODEL


class Echo:
    spec = ToolSpec(
        "echo",
        "Echo the text back.",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    )

    async def __call__(self, args, ctx):
        return ToolResult(f"echo: {args['text']}")


def call_text(name: str, **arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"Calling {name}.\n<tool_call>\n{body}\n</tool_call>"


SCRIPT = [call_text("echo", text="one"), call_text("echo", text="two"), "All done."]


def make_agent(transport, tmp_path, **config) -> Agent:
    registry = ToolRegistry([Echo()])
    settings = {"model": MODEL, "instructions": "You are a test agent.", **config}
    return Agent(transport, registry, ToolContext(workspace=tmp_path), AgentConfig(**settings))


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)


async def run_task(runtime, tmp_path, transport_kind: str, **transport_options):
    engine = scripted_texts(runtime, SCRIPT)
    async with serve_gateway(runtime, engine) as (url, gateway):
        client = client_for(url)
        anthropic_client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        if transport_kind == "ws":
            transport = WebSocketTransport(client, **transport_options)
        elif transport_kind == "chat":
            transport = ChatCompletionsTransport(client)
        elif transport_kind == "messages":
            transport = MessagesTransport(anthropic_client)
        else:
            transport = HttpTransport(client)
        agent = make_agent(transport, tmp_path)
        result = await agent.run("Echo one, then two.")
        await transport.close()
        await anthropic_client.close()
        prompts = [list(r.prompt_token_ids) for r in engine.requests]
        return result, transport, prompts, gateway


async def test_websocket_agent_sends_only_new_items_and_matches_http(runtime, tmp_path):
    ws_result, ws, ws_prompts, _ = await run_task(runtime, tmp_path, "ws")
    http_result, http, http_prompts, _ = await run_task(runtime, tmp_path, "http")
    assert ws_result.stopped == http_result.stopped == "answer"
    assert ws_result.final_text == "All done."
    outputs = [i["output"] for i in ws_result.history if i["type"] == "function_call_output"]
    assert outputs == ["echo: one", "echo: two"]
    # The same conversation reaches the engine token for token...
    assert ws_prompts == http_prompts
    # ...while the WebSocket sent the full request once and then only new items.
    assert (ws.stats.full_calls, ws.stats.incremental_calls) == (1, 2)
    assert ws.stats.bytes_sent < http.stats.bytes_sent
    cost = ws_result.cost
    assert cost.model_calls == 3 and cost.tool_calls == 2
    assert cost.cached_tokens > 0  # later calls hit the prefix of earlier ones
    assert "3 model calls" in cost.line()


@pytest.mark.parametrize("kind", ["chat", "messages"])
async def test_the_stateless_apis_carry_the_same_conversation(runtime, tmp_path, kind):
    """The loop over Chat Completions or Messages: the same prompts as over Responses, and
    the gateway's kept states make every call after the first tokenize what is new."""
    result, transport, prompts, gateway = await run_task(runtime, tmp_path, kind)
    _, _, http_prompts, _ = await run_task(runtime, tmp_path, "http")
    assert result.stopped == "answer" and result.final_text == "All done."
    outputs = [i["output"] for i in result.history if i["type"] == "function_call_output"]
    assert outputs == ["echo: one", "echo: two"]
    assert prompts == http_prompts
    metrics = gateway.metrics
    assert metrics.value(metrics.renders, "incremental") == 2
    assert transport.stats.full_calls == 3 and result.cost.cached_tokens > 0


async def test_lost_chain_is_resent_in_full(runtime, tmp_path):
    # A new connection every turn, with store=false: the server no longer knows the
    # previous response, answers previous_response_not_found, and the full input follows.
    result, ws, prompts, _ = await run_task(runtime, tmp_path, "ws", reconnect_after_s=0)
    assert result.final_text == "All done."
    assert ws.stats.reconnects == 2 and ws.stats.resends == 2
    _, _, http_prompts, _ = await run_task(runtime, tmp_path, "http")
    assert prompts == http_prompts


async def test_http_fallback_when_the_websocket_cannot_open(runtime, tmp_path, monkeypatch):
    async def refuse(self):
        raise TransportError("refused", None, 0)

    monkeypatch.setattr(WebSocketTransport, "_ensure_connection", refuse)
    result, ws, _, _ = await run_task(runtime, tmp_path, "ws")
    assert result.final_text == "All done."
    assert ws.stats.http_fallbacks == 3


async def test_a_partial_response_is_never_replayed(runtime, tmp_path):
    engine = scripted_texts(runtime, ["a long answer " * 20], token_latency_s=0.002)
    async with serve_gateway(runtime, engine) as (url, _):
        transport = WebSocketTransport(client_for(url))
        agent = make_agent(transport, tmp_path)
        seen = []

        def drop_after_three(event):
            seen.append(event["type"])
            if len(seen) == 3:
                raise ConnectionError("network gone")

        agent.on_event = drop_after_three
        with pytest.raises(TransportError) as info:
            await agent.run("Say something long.")
        assert info.value.events_received >= 3
        assert len(engine.requests) == 1  # not sent again, over any transport
        await transport.close()


def test_every_transport_plugs_into_the_loop_seam():
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    messages_client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="x")
    for transport in (
        HttpTransport(client),
        WebSocketTransport(client),
        ChatCompletionsTransport(client),
        MessagesTransport(messages_client),
        ScriptedTransport([]),
    ):
        assert isinstance(transport, Transport)


async def test_the_scripted_transport_streams_like_a_server_and_says_when_its_script_ends():
    transport = ScriptedTransport(["Hello."])
    events = []
    response = await transport.create({"model": "m", "input": []}, events.append)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ]
    assert events[1]["delta"] == "Hello." and events[-1]["response"] is response
    assert response["id"] == "resp_1" and response["usage"]["input_tokens"] > 0
    with pytest.raises(TransportError) as info:
        await transport.create({"model": "m", "input": []})
    assert info.value.code == "script_exhausted" and len(transport.requests) == 2


class Sleepy(Echo):
    spec = ToolSpec("sleepy", "Wait a little.", {"type": "object", "properties": {}})

    async def __call__(self, args, ctx):
        await asyncio.sleep(0.2)
        return ToolResult("rested")


async def test_the_agent_sends_tool_pause_hints_that_reach_the_engine_without_breaking_the_chain(
    runtime, tmp_path
):
    script = [call_text("sleepy"), call_text("echo", text="x"), call_text("sleepy"), "Done."]
    engine = scripted_texts(runtime, script)
    async with serve_gateway(runtime, engine) as (url, _):
        transport = WebSocketTransport(client_for(url))
        registry = ToolRegistry([Echo(), Sleepy()])
        config = AgentConfig(MODEL, "You are a test agent.", prompt_cache_key="session-1")
        agent = Agent(transport, registry, ToolContext(workspace=tmp_path), config)
        result = await agent.run("Rest, echo, rest.")
        await transport.close()
    assert result.stopped == "answer"
    # No estimate before the first tool ran; then one per call, in the metadata field.
    assert [r.session_key for r in engine.requests] == ["session-1"] * 4
    assert transport.stats.incremental_calls == 3  # a changing metadata keeps the chain
    # Call 2 ends in echo (estimated from no run of echo: the all-tools mean, ~0.2 s);
    # call 3 in sleepy (its own estimate, ~0.2 s); the final answer ends the hints.
    assert [key for key, _ in engine.pauses] == ["session-1", "session-1"]
    assert all(0.15 < seconds < 2.0 for _, seconds in engine.pauses)
    table = json.loads(agent.request()["metadata"]["once_tool_pause_s"])
    assert set(table) == {"sleepy", "echo", "*"} and table["sleepy"] > table["echo"]
    assert "(reply)" not in table  # a function-calling harness: an answer is no pause
