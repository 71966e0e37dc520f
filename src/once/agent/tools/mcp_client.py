"""MCP servers as harness tools, through the official `mcp` SDK client.

`McpConnections` connects to several servers at once (stdio subprocesses and streamable
HTTP endpoints), lists each server's tools (following pagination) into `ToolSpec`s whose
namespace is the server's configured name, and wraps each as an `McpTool` whose call is a
`tools/call` on its server. Results (once/mcp_results.py, shared with the gateway's
hosted MCP calls): text content joined; other content named by type;
`isError` becomes `ToolResult(is_error=True)`; a transport failure or a timeout is an
error result too, never an exception the loop must handle.

Each connection lives in its own task ("connection actor"): the SDK's transports hold
anyio task groups that must be entered and exited by one task, and a task per server lets
all servers connect concurrently. Registration order does not leak downstream: `tools()`
is sorted by (namespace, name), whatever order the servers were given or answered in.
"""

import asyncio
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.mcp_results import result_text

DEFAULT_CONNECT_TIMEOUT_S = 30.0
DEFAULT_CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class McpServerConfig:
    """One server, as a user configures it: a command to spawn (stdio) or a URL (HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None

    def __post_init__(self):
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of command or url")

    @property
    def namespace(self) -> str:
        return namespace_for(self.name)

    def client(self) -> Client:
        if self.url is not None:
            return Client(self.url)
        assert self.command is not None  # __post_init__: exactly one of command and url
        params = StdioServerParameters(
            command=self.command, args=list(self.args), env=self.env, cwd=self.cwd
        )
        return Client(params)


def namespace_for(server_name: str) -> str:
    """A server name as a function-name prefix: only [A-Za-z0-9_-], and never the `__`
    that separates namespace from tool name."""
    namespace = re.sub(r"[^A-Za-z0-9_-]+", "-", server_name).strip("-")
    namespace = re.sub(r"_{2,}", "_", namespace)
    if not namespace:
        raise ValueError(f"MCP server name {server_name!r} has no usable characters")
    return namespace


def python_server(name: str, module: str, *args: str) -> McpServerConfig:
    """A stdio server that is a Python module run by this interpreter (tests, benchmarks)."""
    return McpServerConfig(name, command=sys.executable, args=("-m", module, *args))


@dataclass
class McpTool:
    """One remote tool; `__call__` is a `tools/call` on the server that listed it."""

    spec: ToolSpec
    connection: "McpConnection" = field(repr=False)
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        return await self.connection.call(self.spec.name, args, self.timeout_s)


class McpConnection:
    """One server's session, held open by its own task until `close()`."""

    def __init__(self, config: McpServerConfig):
        self.config = config
        self.client: Client | None = None
        self.specs: list[ToolSpec] = []
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def open(self, timeout_s: float) -> None:
        self._task = asyncio.create_task(self._hold(), name=f"mcp:{self.config.name}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            self._task.cancel()
            await self.close()
            raise ConnectionError(
                f"MCP server {self.config.name!r} did not answer within {timeout_s:g} s"
            ) from None

    async def _hold(self) -> None:
        try:
            async with self.config.client() as client:
                self.client = client
                self.specs = await self._list_specs(client)
                self._ready.set_result(None)
                await self._closing.wait()
        except Exception as e:  # noqa: BLE001 - before ready: open() raises it; after: calls fail
            if not self._ready.done():
                name, kind = self.config.name, type(e).__name__
                self._ready.set_exception(ConnectionError(f"MCP server {name!r}: {kind}: {e}"))
        finally:
            self.client = None
            if not self._ready.done():
                self._ready.cancel()

    async def _list_specs(self, client: Client) -> list[ToolSpec]:
        specs: list[ToolSpec] = []
        namespace = self.config.namespace
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                parameters = dict(tool.input_schema or {"type": "object", "properties": {}})
                specs.append(ToolSpec(tool.name, tool.description or "", parameters, namespace))
            cursor = page.next_cursor
            if cursor is None:
                return sorted(specs, key=lambda s: s.name)

    async def call(self, name: str, args: dict, timeout_s: float) -> ToolResult:
        client = self.client
        where = f"{self.config.namespace}.{name}"
        if client is None:
            return ToolResult(f"MCP server of {where} is not connected", True)
        try:
            result = await asyncio.wait_for(client.call_tool(name, args), timeout_s)
        except TimeoutError:
            return ToolResult(f"{where} timed out after {timeout_s:g} s", True)
        except Exception as e:  # noqa: BLE001 - protocol and transport errors the model sees
            return ToolResult(f"{where} failed: {type(e).__name__}: {e}", True)
        return ToolResult(result_text(result), bool(result.is_error), {"server": self.config.name})

    async def close(self) -> None:
        self._closing.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


class McpConnections:
    """`async with McpConnections(configs) as mcp:` connects every server concurrently;
    `mcp.tools()` are the tools of all of them, sorted."""

    def __init__(
        self,
        configs: Sequence[McpServerConfig],
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ):
        namespaces = [c.namespace for c in configs]
        duplicates = sorted({n for n in namespaces if namespaces.count(n) > 1})
        if duplicates:
            raise ValueError(f"two MCP servers share the namespace {duplicates[0]!r}")
        self.configs = list(configs)
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self.connections: list[McpConnection] = []

    async def __aenter__(self) -> "McpConnections":
        self.connections = [McpConnection(c) for c in self.configs]
        opened = await asyncio.gather(
            *(c.open(self.connect_timeout_s) for c in self.connections), return_exceptions=True
        )
        failures = [e for e in opened if isinstance(e, BaseException)]
        if failures:
            await self.aclose()
            raise failures[0]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self.connections))

    def tools(self) -> list[McpTool]:
        tools = [
            McpTool(spec, connection, self.call_timeout_s)
            for connection in self.connections
            for spec in connection.specs
        ]
        return sorted(tools, key=lambda t: (t.spec.namespace, t.spec.name))

    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self.tools()]
