"""An agent session as `once agent` runs it: tools, policy, sandbox, transport, printing.

The prompt is built once per session and never edited: fixed instructions (no dates,
ids or policy text), the tool list sorted by the registry (core tools, Code Mode's
`code`, MCP tools or, above the deferral threshold, `tool_search`), and the history.
"""

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import openai

from once.agent.doctor import CacheDoctor
from once.agent.loop import Agent, AgentConfig, AgentResult
from once.agent.policy import ApprovalPolicy
from once.agent.tools.base import Approver, Tool, ToolContext, ToolResult
from once.agent.tools.catalog import ToolCatalog
from once.agent.tools.code_mode import CodeModeTool
from once.agent.tools.discovery import DeferredTools
from once.agent.tools.patch import ApplyPatchTool
from once.agent.tools.registry import ToolRegistry
from once.agent.tools.sandbox import Sandbox
from once.agent.tools.shell import ShellTool
from once.agent.transport.base import Transport
from once.agent.transport.http import HttpTransport
from once.agent.transport.websocket import WebSocketTransport

if TYPE_CHECKING:  # the MCP SDK loads only when a session has MCP servers
    from once.agent.tools.mcp_client import McpServerConfig

INSTRUCTIONS = (
    "You are a coding agent working in a repository. Use the tools to inspect and change "
    "files and to run commands; prefer small, verifiable steps. When the task is done, "
    "answer with a short summary and no tool call."
)


@dataclass
class AgentOptions:
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key: str = "unused"
    model: str = "smollm2-135m-instruct"
    transport: str = "ws"  # ws | http
    approval: str = "on-request"
    workspace: Path = field(default_factory=Path.cwd)
    max_steps: int = 30
    max_output_tokens: int | None = None
    code_mode: bool = False
    instructions: str = INSTRUCTIONS
    session_key: str | None = None


def make_transport(options: AgentOptions) -> Transport:
    client = openai.AsyncOpenAI(base_url=options.base_url, api_key=options.api_key)
    if options.transport == "http":
        return HttpTransport(client)
    return WebSocketTransport(client)


def core_tools(options: AgentOptions) -> list[Tool]:
    tools: list[Tool] = [ShellTool(), ApplyPatchTool()]
    if options.code_mode:
        tools.append(CodeModeTool([t.spec for t in tools]))
    return tools


def terminal_approver(stream: TextIO = sys.stdin) -> Approver | None:
    """Ask on the terminal; with no terminal there is nobody to ask (deny)."""
    if not stream.isatty():
        return None

    def approve(tool: str, args: dict) -> bool:
        answer = input(f"\nallow {tool} {args}? [y/N] ")
        return answer.strip().lower() in ("y", "yes")

    return approve


def build_agent(
    options: AgentOptions,
    *,
    out: TextIO = sys.stdout,
    mcp_tools: Sequence[Tool] = (),
    transport: Transport | None = None,
) -> Agent:
    """The agent of one session; `mcp_tools` are the tools of the user's MCP servers.

    With MCP tools, the deferral policy decides the request's fixed `tools`: everything
    inline when small, else the core tools plus `tool_search` over the catalog. Every
    catalog tool is registered either way, so a call is validated against its full schema.
    `transport`: the options' (WebSocket or HTTP to `base_url`) unless given.
    """
    core = core_tools(options)
    registry = ToolRegistry(core)
    discovery = None
    if mcp_tools:
        catalog = ToolCatalog(mcp_tools)
        discovery = DeferredTools([t.spec for t in core], catalog)
        for tool in discovery.tools():
            registry.register(tool)
        for refused in catalog.register_into(registry):
            print(f"tool not registered: {refused}", file=out)
    sandbox = Sandbox()
    ctx = ToolContext(
        workspace=options.workspace,
        policy=ApprovalPolicy(options.approval),
        sandbox=sandbox,
        approve=terminal_approver(),
    )
    config = AgentConfig(
        model=options.model,
        instructions=options.instructions,
        max_steps=options.max_steps,
        max_output_tokens=options.max_output_tokens,
        prompt_cache_key=options.session_key,
    )
    printer = TranscriptPrinter(out)
    print(sandbox.describe(), file=out)
    return Agent(
        transport if transport is not None else make_transport(options),
        registry,
        ctx,
        config,
        tools=discovery.request_tools() if discovery is not None else None,
        on_event=printer.event,
        on_tool=printer.tool,
        doctor=CacheDoctor(),
        discovery=discovery,
    )


class TranscriptPrinter:
    """Streams the model's text and shows each tool call with the head of its result."""

    def __init__(self, out: TextIO):
        self.out = out

    def event(self, event: dict) -> None:
        if event["type"] == "response.output_text.delta":
            self.out.write(event.get("delta", ""))
            self.out.flush()
        elif event["type"] in ("response.completed", "response.incomplete"):
            self.out.write("\n")

    def tool(self, call: dict, result: ToolResult) -> None:
        head = result.output if len(result.output) < 400 else result.output[:400] + " ..."
        mark = "error" if result.is_error else "ok"
        print(f"-> {call.get('name')}({call.get('arguments')}) [{mark}]\n{head}", file=self.out)


def mcp_configs(specs: list[str]) -> list["McpServerConfig"]:
    """`--mcp name=command arg ...` (stdio) or `--mcp name=http://...` (streamable HTTP)."""
    import shlex

    from once.agent.tools.mcp_client import McpServerConfig

    configs = []
    for spec in specs:
        name, sep, target = spec.partition("=")
        if not sep or not name or not target:
            raise ValueError(f"--mcp wants name=command or name=url, got {spec!r}")
        if target.startswith(("http://", "https://")):
            configs.append(McpServerConfig(name, url=target))
        else:
            command, *args = shlex.split(target)
            configs.append(McpServerConfig(name, command=command, args=tuple(args)))
    return configs


async def run_cli_session(
    options: AgentOptions, tasks: Iterable[str], mcp: list[str], out: TextIO = sys.stdout
) -> AgentResult | None:
    from once.agent.tools.mcp_client import McpConnections

    async with McpConnections(mcp_configs(mcp)) as connections:
        agent = build_agent(options, out=out, mcp_tools=connections.tools())
        return await run_session(agent, tasks, out)


async def run_session(
    agent: Agent, tasks: Iterable[str], out: TextIO = sys.stdout
) -> AgentResult | None:
    """One-shot (one task) or interactive (a task per line, one session)."""
    result = None
    try:
        for task in tasks:
            result = await agent.run(task)
            print(f"[{result.stopped}] {agent.cost.line()}", file=out)
            if agent.doctor is not None and agent.doctor.breaks:
                print(agent.doctor.report(), file=out)
    finally:
        await agent.transport.close()
    return result
