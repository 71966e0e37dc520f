"""Code Mode vs one tool call per model call, on real MCP tools served over stdio.

The tools are LiveMCPBench's yahoo-finance server, served by `catalog_server` with a
delay per call (>= 100 ms, like a real API) and results of about 800 characters (a
small table: the real server returns JSON tables of several KB), discovered through the
MCP SDK client. The
model is scripted behind the real gateway, so both runs make real model calls:

- sequential: N model calls, each calling one tool, then the answer (N + 1 calls);
- Code Mode: one call to `code` with a program that runs the N tools under
  `Promise.all` and returns a compact summary, then the answer (2 calls).

Reported: wall time of each task, and the tokens the tool work added to the model's
context (input tokens of the last call minus the first).
"""

import asyncio
import json
import time

import openai

from once.agent.loop import Agent, AgentConfig
from once.agent.tools.base import ToolContext
from once.agent.tools.code_mode import CodeModeTool
from once.agent.tools.mcp_client import McpConnections, python_server
from once.agent.tools.registry import ToolRegistry
from once.agent.transport.websocket import WebSocketTransport
from once.bench.traces import default_traces_dir
from once.gateway.testing import scripted_texts, serve_gateway

SERVER = "yahoo-finance"


def catalog_path():
    return default_traces_dir().parent / "tool_retrieval/livemcpbench/tools/LiveMCPTool/tools.json"


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _arguments(spec) -> dict:
    required = spec.parameters.get("required") or []
    return {name: "AAPL" for name in required}


def _program(specs) -> str:
    calls = ",\n  ".join(
        f"tools[{json.dumps(s.function_name)}]({json.dumps(_arguments(s))})" for s in specs
    )
    return (
        f"const results = await Promise.all([\n  {calls}\n]);\n"
        "return results.map(r => r.split(' ')[1]).join(',');"
    )


async def _run(runtime, registry, script, tmp) -> tuple[float, int, int]:
    engine = scripted_texts(runtime, script)
    async with serve_gateway(runtime, engine) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        transport = WebSocketTransport(client)
        config = AgentConfig(model=runtime.name, instructions="Look up the data.", max_steps=20)
        ctx = ToolContext(workspace=tmp)
        agent = Agent(transport, registry, ctx, config)
        start = time.perf_counter()
        result = await agent.run("Collect the quotes.")
        wall = time.perf_counter() - start
        await transport.close()
    if result.stopped != "answer":
        raise RuntimeError(f"the scripted task did not finish: {result.stopped}")
    failed = [r for r in ctx.transcript if r.result.is_error]
    if failed:  # a benchmark of failing calls would measure nothing
        raise RuntimeError(f"tool call failed: {failed[0].name}: {failed[0].result.output}")
    context = result.usages[-1]["input_tokens"] - result.usages[0]["input_tokens"]
    return wall, context, result.cost.model_calls


async def measure(
    runtime, tmp, num_calls: int = 6, delay_ms: int = 150, result_chars: int = 800
) -> dict:
    config = python_server(
        SERVER, "once.agent.tools.catalog_server",
        "--catalog", str(catalog_path()), "--server", SERVER, "--delay-ms", str(delay_ms),
        "--result-chars", str(result_chars),
    )  # fmt: skip
    async with McpConnections([config]) as mcp:
        tools = mcp.tools()[:num_calls]
        specs = [t.spec for t in tools]
        sequential_script = [_call(s.function_name, _arguments(s)) for s in specs] + ["Done."]
        code_script = [_call("code", {"code": _program(specs)}), "Done."]
        sequential = await _run(runtime, ToolRegistry(tools), sequential_script, tmp)
        code_registry = ToolRegistry([*tools, CodeModeTool(specs)])
        code = await _run(runtime, code_registry, code_script, tmp)
    return {
        "tool_calls": len(specs),
        "tool_delay_ms": delay_ms,
        "tool_result_chars": result_chars,
        "sequential_wall_s": sequential[0],
        "code_mode_wall_s": code[0],
        "code_mode_wall_ratio": sequential[0] / code[0],
        "sequential_context_tokens": sequential[1],
        "code_mode_context_tokens": code[1],
        "code_mode_context_ratio": sequential[1] / max(1, code[1]),
        "sequential_model_calls": sequential[2],
        "code_mode_model_calls": code[2],
    }


def run(runtime, tmp) -> dict:
    result = asyncio.run(measure(runtime, tmp))
    # How much the context figure owes to the result size: the same with one-line results.
    tiny = asyncio.run(measure(runtime, tmp, result_chars=0))
    result["code_mode_context_ratio_one_line_results"] = tiny["code_mode_context_ratio"]
    return result
