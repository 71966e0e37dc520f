"""The tool seam of the harness: what every tool is, gets, and gives back.

A tool has a `spec` (name, description, JSON schema, namespace) and is called as
`await tool(args, ctx)`. Errors the model should see (a failing command, a patch that
does not apply, bad arguments) are `ToolResult(is_error=True)`, never exceptions: the
loop sends every result back to the model as a `function_call_output`.

The context a call gets holds the live harness state it is run under: the approval policy
(a `ToolPolicy`; the harness's is agent/policy.py's), the sandbox and, for tools that call
tools, the registry (a `ToolCaller`; the harness's is registry.py's). Both are declared
here as protocols, so this module depends on neither implementation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from once.agent.tools.sandbox import Sandbox

# OpenAI function names allow [A-Za-z0-9_-]; a namespaced tool is sent as
# "<namespace>__<name>" and shown to people as "<namespace>.<name>".
NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    namespace: str = ""  # the MCP server's name; "" for built-in tools

    @property
    def function_name(self) -> str:
        return f"{self.namespace}{NAMESPACE_SEPARATOR}{self.name}" if self.namespace else self.name

    @property
    def display_name(self) -> str:
        return f"{self.namespace}.{self.name}" if self.namespace else self.name

    def to_function_tool(self, parameters: dict | None = None) -> dict:
        """The Responses API function tool; `parameters` overrides (a compressed schema)."""
        return {
            "type": "function",
            "name": self.function_name,
            "description": self.description,
            "parameters": self.parameters if parameters is None else parameters,
            "strict": False,
        }


@dataclass
class ToolResult:
    output: str
    is_error: bool = False
    metadata: dict = field(default_factory=dict)


@dataclass
class ToolCallRecord:
    """One executed call, for the transcript (nested Code Mode calls included)."""

    name: str
    arguments: dict
    result: ToolResult
    elapsed_s: float
    parent: str | None = None  # the Code Mode call it ran inside, if any


# Asks the user whether a tool may run: (tool's display name, arguments) -> yes or no.
Approver = Callable[[str, dict], bool | Awaitable[bool]]


@dataclass
class ToolContext:
    workspace: Path
    # Live harness state: the approval policy and the sandbox are read at each call, so a
    # change takes effect at the next execution and never touches earlier prompt bytes.
    policy: ToolPolicy | None = None  # None: every call runs
    sandbox: Sandbox | None = None  # None: the shell tool probes the default sandbox
    approve: Approver | None = None  # None: nobody to ask, so a policy that asks denies
    transcript: list[ToolCallRecord] = field(default_factory=list)
    registry: ToolCaller | None = None  # for tools that call tools (Code Mode)
    call_id: str | None = None  # the model's call now running (nested calls' parent)


@runtime_checkable
class Tool(Protocol):
    spec: ToolSpec

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult: ...


class ToolPolicy(Protocol):
    """Asked by the registry before every call; a denial becomes an error result."""

    async def authorize(self, spec: ToolSpec, args: dict, ctx: ToolContext) -> Decision: ...


@dataclass(frozen=True)
class Decision:
    """A policy's answer for one call; `sandboxed` says whether it runs in the sandbox."""

    allowed: bool
    reason: str
    sandboxed: bool = True


class ToolCaller(Protocol):
    """What a tool that calls tools sees of the registry."""

    def specs(self) -> list[ToolSpec]: ...

    async def call(
        self,
        function_name: str,
        arguments: str | dict,
        ctx: ToolContext,
        *,
        parent: str | None = None,
    ) -> ToolResult: ...
