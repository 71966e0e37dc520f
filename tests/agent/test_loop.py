"""The agent loop's logic, on the in-memory ScriptedTransport (no gateway, no socket).

What goes over the wire (WebSocket vs HTTP, recovery) is tested against the real gateway
in test_transports.py.
"""

import io
import json
import sys

from once.agent.loop import Agent, AgentConfig
from once.agent.session import AgentOptions, build_agent, run_session
from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.registry import ToolRegistry
from once.agent.transport.fake import ScriptedTransport, function_call, scripted_response

MODEL = "scripted-model"


class Echo:
    spec = ToolSpec(
        "echo",
        "Echo the text back.",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    )

    async def __call__(self, args, ctx):
        return ToolResult(f"echo: {args['text']}")


def make_agent(transport, tmp_path, **config) -> Agent:
    registry = ToolRegistry([Echo()])
    settings = {"model": MODEL, "instructions": "You are a test agent.", **config}
    return Agent(transport, registry, ToolContext(workspace=tmp_path), AgentConfig(**settings))


async def test_tool_results_follow_their_calls_and_the_answer_ends_the_task(tmp_path):
    script = [function_call("echo", text="one"), function_call("echo", text="two"), "All done."]
    transport = ScriptedTransport(script)
    result = await make_agent(transport, tmp_path).run("Echo one, then two.")
    assert (result.stopped, result.final_text) == ("answer", "All done.")
    outputs = [i["output"] for i in result.history if i["type"] == "function_call_output"]
    assert outputs == ["echo: one", "echo: two"]
    # Each request is the last one plus its output plus the new items: append-only.
    first, second, third = (request["input"] for request in transport.requests)
    assert second[: len(first)] == first and third[: len(second)] == second
    assert (transport.stats.full_calls, transport.stats.incremental_calls) == (1, 2)
    assert result.cost.model_calls == 3 and result.cost.tool_calls == 2
    assert result.cost.cached_tokens > 0  # later calls share the prefix of earlier ones


async def test_budget_and_bad_tool_calls(tmp_path):
    script = [
        function_call("nope", x=1),
        function_call("echo", wrong=1),
        function_call("echo", text="x"),
    ]
    transport = ScriptedTransport(script)
    agent = make_agent(transport, tmp_path, max_steps=3)
    result = await agent.run("Try tools.")
    outputs = [i["output"] for i in result.history if i["type"] == "function_call_output"]
    assert outputs[0].startswith("unknown tool 'nope'")
    assert "invalid arguments for echo" in outputs[1] and "full schema" in outputs[1]
    assert outputs[2] == "echo: x"
    assert result.stopped == "max_steps"


async def test_the_token_budget_stops_the_task(tmp_path):
    usage = {"input_tokens": 60, "output_tokens": 5}
    script = [scripted_response(function_call("echo", text=str(i)), usage=usage) for i in range(5)]
    result = await make_agent(ScriptedTransport(script), tmp_path, max_total_tokens=100).run("Go.")
    assert result.stopped == "max_tokens" and result.cost.model_calls == 2


async def test_compaction_starts_a_new_chain_from_a_handoff_summary(tmp_path):
    usage = {"input_tokens": 500, "output_tokens": 5}
    script = [
        scripted_response(function_call("echo", text="a"), usage=usage),
        "Summary: echoed a.",  # the answer to the handoff prompt
        "Done.",
    ]
    transport = ScriptedTransport(script)
    agent = make_agent(transport, tmp_path, compact_at_tokens=400)
    result = await agent.run("Echo a.")
    assert result.final_text == "Done." and result.cost.compactions == 1
    after = transport.requests[2]["input"]
    assert after[0] == {"type": "message", "role": "user", "content": "Echo a."}
    assert after[-1]["content"] == "Handoff summary:\nSummary: echoed a."


async def test_session_runs_real_tools_prints_the_transcript_and_a_clean_doctor(tmp_path):
    script = [function_call("shell", command="echo hello > out.txt && cat out.txt"), "Wrote it."]
    options = AgentOptions(workspace=tmp_path, approval="never")
    out = io.StringIO()
    agent = build_agent(options, out=out, transport=ScriptedTransport(script))
    result = await run_session(agent, ["Write hello to out.txt."], out=out)
    assert result.stopped == "answer" and result.final_text == "Wrote it."
    assert (tmp_path / "out.txt").read_text() == "hello\n"
    text = out.getvalue()
    assert "-> shell(" in text and "hello" in text and "2 model calls" in text
    assert agent.doctor.breaks == []  # an append-only session never breaks its prefix
    assert agent.cost.incremental_calls == 1
    assert agent.transport.closed  # the session closes its transport


async def test_deferred_discovery_over_mcp_keeps_the_prefix(tmp_path):
    """A big MCP catalog: the request carries shell, apply_patch and tool_search only; a
    search loads a tool at the tail, the model calls it, and no request breaks the prefix."""
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
        function_call("tool_search", query="weather forecast tomorrow"),
        function_call("weather__get_forecast", city="Paris"),
        "Sunny.",
    ]
    async with McpConnections([server]) as mcp:
        options = AgentOptions(workspace=tmp_path, approval="never")
        out = io.StringIO()
        transport = ScriptedTransport(script)
        agent = build_agent(options, out=out, mcp_tools=mcp.tools(), transport=transport)
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
