"""The agent loop and its transports against the real gateway with a scripted model."""

import json

import openai
import pytest

from once.agent.loop import Agent, AgentConfig
from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.registry import ToolRegistry
from once.agent.transport.http import HttpTransport, TransportError
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
        if transport_kind == "ws":
            transport = WebSocketTransport(client, **transport_options)
        else:
            transport = HttpTransport(client)
        agent = make_agent(transport, tmp_path)
        result = await agent.run("Echo one, then two.")
        await transport.close()
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


async def test_budget_and_bad_tool_calls(runtime, tmp_path):
    script = [call_text("nope", x=1), call_text("echo", wrong=1), call_text("echo", text="x")]
    engine = scripted_texts(runtime, script)
    async with serve_gateway(runtime, engine) as (url, _):
        transport = HttpTransport(client_for(url))
        agent = make_agent(transport, tmp_path, max_steps=3)
        result = await agent.run("Try tools.")
    outputs = [i["output"] for i in result.history if i["type"] == "function_call_output"]
    assert outputs[0].startswith("unknown tool 'nope'")
    assert "invalid arguments for echo" in outputs[1] and "full schema" in outputs[1]
    assert outputs[2] == "echo: x"
    assert result.stopped == "max_steps"


async def test_session_runs_real_tools_prints_the_transcript_and_a_clean_doctor(runtime, tmp_path):
    import io

    from once.agent.session import AgentOptions, build_agent, run_session

    script = [call_text("shell", command="echo hello > out.txt && cat out.txt"), "Wrote it."]
    engine = scripted_texts(runtime, script)
    async with serve_gateway(runtime, engine) as (url, _):
        options = AgentOptions(base_url=f"{url}/v1", workspace=tmp_path, approval="never")
        out = io.StringIO()
        agent = build_agent(options, out=out)
        result = await run_session(agent, ["Write hello to out.txt."], out=out)
    assert result.stopped == "answer" and result.final_text == "Wrote it."
    assert (tmp_path / "out.txt").read_text() == "hello\n"
    text = out.getvalue()
    assert "-> shell(" in text and "hello" in text and "2 model calls" in text
    assert agent.doctor.breaks == []  # an append-only session never breaks its prefix
    assert agent.cost.incremental_calls == 1


async def test_deferred_discovery_over_mcp_keeps_the_prefix(runtime, tmp_path):
    """A big MCP catalog: the request carries shell, apply_patch and tool_search only; a
    search loads a tool at the tail, the model calls it, and no request breaks the prefix."""
    import io
    import sys

    from once.agent.session import AgentOptions, build_agent, run_session
    from once.agent.tools.mcp_client import McpConnections, McpServerConfig

    tools = [
        {
            "name": f"metric_{i}",
            "description": f"Report weather metric number {i} for a city. " + "detail " * 40,
            "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
        for i in range(40)
    ]
    tools.append(
        {
            "name": "get_forecast",
            "description": "Get tomorrow's weather forecast for a city.",
            "inputSchema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    )
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"weather": tools}))
    server = McpServerConfig(
        "weather",
        command=sys.executable,
        args=("-m", "once.agent.tools.catalog_server", "--catalog", str(catalog)),
    )
    script = [
        call_text("tool_search", query="weather forecast tomorrow"),
        call_text("weather__get_forecast", city="Paris"),
        "Sunny.",
    ]
    engine = scripted_texts(runtime, script)
    async with serve_gateway(runtime, engine) as (url, _):
        async with McpConnections([server]) as mcp:
            options = AgentOptions(base_url=f"{url}/v1", workspace=tmp_path, approval="never")
            out = io.StringIO()
            agent = build_agent(options, out=out, mcp_tools=mcp.tools())
            result = await run_session(agent, ["Weather in Paris tomorrow?"], out=out)
    assert result.final_text == "Sunny."
    assert sorted(t["name"] for t in agent.tools) == ["apply_patch", "shell", "tool_search"]
    kinds = [item["type"] for item in result.history]
    assert "tool_search_output" in kinds
    loaded = next(i for i in result.history if i["type"] == "tool_search_output")
    assert "weather__get_forecast" in [t["name"] for t in loaded["tools"]]
    outputs = [i["output"] for i in result.history if i["type"] == "function_call_output"]
    assert outputs[-1].startswith("weather.get_forecast ok")
    assert agent.doctor.breaks == [] and agent.cost.incremental_calls == 2
