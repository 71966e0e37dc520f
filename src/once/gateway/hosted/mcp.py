"""Remote MCP servers as a hosted tool: the gateway lists and calls them inside a response.

For a request's `{"type": "mcp", ...}` tool (mcp_policy.py says what it allows):

- before generation, a server the conversation has not listed yet is listed
  (`tools/list` over streamable HTTP, with the request's `headers` and `authorization`):
  an `mcp_list_tools` item with its allowed tools, or with `error` when the server cannot
  be reached; render.py shows the tools to the model as a namespace named `server_label`;
- the model's call of one (`<server_label>.<tool>`) is an `mcp_call` item, shown in
  progress while the gateway calls the server and done with its `output` or `error`; the
  model reads the result and goes on in the same response;
- a call that needs approval is an `mcp_approval_request` instead, and the response ends
  there; the next request's `mcp_approval_response` runs it (`approve: true`: an
  `mcp_call` with `approval_request_id`) or not (the model reads that it was declined),
  before generation, and the response goes on.

Nothing here fails a response: an unreachable server, a timeout, a protocol error are the
item's `error` (`http_error` 502 or 504 without an HTTP status of its own,
`mcp_protocol_error` with the JSON-RPC code, `mcp_tool_execution_error` for a tool's own
`isError` result). Each listing and call opens its own session: a response holds no
connection between steps, and a conversation's next request may reach another gateway.

`McpServers` is the seam (one server reached as a config says); `StreamableHttpServers` is
the real one (the `mcp` SDK's client), and tests reach real servers on loopback.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from once.gateway.hosted.base import HostedOutcome, HostedTurn
from once.gateway.hosted.mcp_policy import (
    MCP_APPROVAL_REQUEST,
    MCP_APPROVAL_RESPONSE,
    MCP_CALL,
    MCP_LIST_TOOLS,
    MCP_TOOL,
    is_allowed,
    latest_listing,
    mcp_servers,
)
from once.mcp_results import result_text
from once.protocol.errors import InvalidRequestError
from once.protocol.responses import ResponsesRequest

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_CALL_TIMEOUT_S = 60.0
UNREACHABLE = 502  # the http_error code of a server that did not answer at all
TIMED_OUT = 504
INVALID_PARAMS = -32602  # JSON-RPC's code, for a call refused before it reaches the server


class McpFailure(Exception):
    """A server that could not answer: `error` is the SDK's McpToolCallError shape."""

    def __init__(self, error: dict):
        super().__init__(error.get("message") or error["type"])
        self.error = error


class McpServers(Protocol):
    async def list_tools(self, config: dict) -> list[dict]:
        """The server's tools as `mcp_list_tools` holds them (name, description,
        input_schema, annotations); raises McpFailure."""
        ...

    async def call_tool(self, config: dict, name: str, arguments: dict) -> tuple[str, bool]:
        """(the result as text, whether the tool reported an error); raises McpFailure."""
        ...


class StreamableHttpServers:
    """Each server reached at its `server_url` over streamable HTTP, a session per use."""

    def __init__(
        self,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ):
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s

    async def list_tools(self, config: dict) -> list[dict]:
        async with self._session(config, self.connect_timeout_s) as client:
            listed: list[dict] = []
            cursor: str | None = None
            while True:
                page = await client.list_tools(cursor=cursor)
                listed.extend(_listed(tool) for tool in page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    return listed

    async def call_tool(self, config: dict, name: str, arguments: dict) -> tuple[str, bool]:
        async with self._session(config, self.call_timeout_s) as client:
            result = await client.call_tool(name, arguments)
            return result_text(result), bool(result.is_error)

    @contextlib.asynccontextmanager
    async def _session(self, config: dict, timeout_s: float) -> AsyncIterator[Client]:
        headers = dict(config.get("headers") or {})
        if config.get("authorization"):
            headers.setdefault("Authorization", f"Bearer {config['authorization']}")
        url = str(config.get("server_url") or "")
        timeout = httpx2.Timeout(self.connect_timeout_s, read=timeout_s)
        try:
            async with asyncio.timeout(self.connect_timeout_s + timeout_s):
                async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
                    async with Client(streamable_http_client(url, http_client=http)) as client:
                        yield client
        except McpFailure:
            raise
        except TimeoutError:
            raise McpFailure(
                _http_error(TIMED_OUT, f"{url} timed out after {timeout_s:g} s")
            ) from None
        except Exception as e:  # noqa: BLE001 - every failure of a server is its item's error
            raise McpFailure(_failure(_innermost(e), url)) from None


def _listed(tool: Any) -> dict:
    entry: dict = {"name": tool.name, "input_schema": dict(tool.input_schema or {})}
    if tool.description:
        entry["description"] = tool.description
    if tool.annotations is not None:
        entry["annotations"] = tool.annotations.model_dump(by_alias=True, exclude_none=True)
    return entry


def _innermost(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _failure(error: BaseException, url: str) -> dict:
    if isinstance(error, MCPError):
        return {"type": "mcp_protocol_error", "code": error.code, "message": error.message}
    if isinstance(error, httpx2.HTTPStatusError):
        return _http_error(error.response.status_code, f"{url}: {error}")
    if isinstance(error, TimeoutError | httpx2.TimeoutException):
        return _http_error(TIMED_OUT, f"{url} timed out")
    return _http_error(UNREACHABLE, f"{url} could not be reached: {type(error).__name__}: {error}")


def _http_error(code: int, message: str) -> dict:
    return {"type": "http_error", "code": code, "message": message}


class RemoteMcp:
    """The hosted tool behind `{"type": "mcp"}` tools."""

    tool_types: tuple[str, ...] = (MCP_TOOL,)

    def __init__(self, servers: McpServers | None = None):
        self.servers = servers or StreamableHttpServers()

    def handles(self, item: dict, request: ResponsesRequest) -> bool:
        return item["type"] in (MCP_CALL, MCP_APPROVAL_REQUEST) and (
            item.get("server_label") in mcp_servers(request.tools)
        )

    async def run(self, call: dict, turn: HostedTurn) -> HostedOutcome:
        if call["type"] == MCP_APPROVAL_REQUEST:
            return HostedOutcome(suspend=True)  # the client answers with its approval
        config = mcp_servers(turn.request.tools)[call["server_label"]]
        return HostedOutcome([await self._called(config, call, turn)])

    def prompt_functions(self, request: ResponsesRequest) -> Sequence[dict]:
        return ()

    def opens(self, request: ResponsesRequest) -> bool:
        return bool(mcp_servers(request.tools)) or any(
            item["type"] == MCP_APPROVAL_RESPONSE for item in request.input_items
        )

    async def open(self, turn: HostedTurn) -> HostedOutcome | None:
        """List the servers the conversation has not listed; run the approved calls."""
        servers = mcp_servers(turn.request.tools)
        unlisted = [
            (label, c) for label, c in servers.items() if not latest_listing(turn.items, label)
        ]
        # Listed together (one server's delay is the response's, not their sum), in order.
        items = list(await asyncio.gather(*(self._listing(label, c) for label, c in unlisted)))
        for approval in turn.request.input_items:
            if approval["type"] == MCP_APPROVAL_RESPONSE:
                call = self._approved_call(approval, turn, servers)
                if call is not None:
                    items.append(await self._called(servers[call["server_label"]], call, turn))
        return HostedOutcome(items) if items else None

    async def _listing(self, label: str, config: dict) -> dict:
        item: dict = {"type": MCP_LIST_TOOLS, "server_label": label, "tools": []}
        try:
            listed = await self.servers.list_tools(config)
        except McpFailure as e:
            return {**item, "error": str(e)}
        return {**item, "tools": [tool for tool in listed if is_allowed(config, tool)]}

    def _approved_call(
        self, approval: dict, turn: HostedTurn, servers: dict[str, dict]
    ) -> dict | None:
        """The call an approval response approves (None: it declines, or was answered)."""
        request_id = approval.get("approval_request_id")
        asked = next(
            (
                i
                for i in turn.items
                if i["type"] == MCP_APPROVAL_REQUEST and i.get("id") == request_id
            ),
            None,
        )
        if asked is None or asked.get("server_label") not in servers:
            raise InvalidRequestError(
                f"no mcp_approval_request {request_id!r} of a server this request declares "
                "in the conversation",
                param=turn.param_of(approval, "approval_request_id"),
            )
        answered = any(
            i["type"] == MCP_CALL and i.get("approval_request_id") == request_id
            for i in (*turn.items, *turn.output)
        )
        if answered or not approval.get("approve"):
            return None
        return {
            "type": MCP_CALL,
            "server_label": asked["server_label"],
            "name": asked["name"],
            "arguments": asked.get("arguments") or "{}",
            "approval_request_id": request_id,
        }

    async def _called(self, config: dict, call: dict, turn: HostedTurn) -> dict:
        """The call, done: its output, or its error. Only a tool the conversation's listing
        holds (an allowed one) reaches the server."""
        done = {**call, "status": "completed", "output": None, "error": None}
        label, name = call["server_label"], call["name"]
        listing = latest_listing(turn.output, label) or latest_listing(turn.items, label) or {}
        try:
            arguments = json.loads(call.get("arguments") or "{}")
        except ValueError:
            arguments = None
        refusal = None
        if name not in {tool.get("name") for tool in listing.get("tools") or ()}:
            refusal = f"{label} has no tool {name!r} this request allows"
        elif not isinstance(arguments, dict):
            refusal = "the arguments must be a JSON object"
        if refusal is not None:
            error = {"type": "mcp_protocol_error", "code": INVALID_PARAMS, "message": refusal}
            return {**done, "status": "failed", "error": error}
        try:
            text, is_error = await self.servers.call_tool(config, call["name"], arguments)
        except McpFailure as e:
            return {**done, "status": "failed", "error": e.error}
        if is_error:
            content = [{"type": "text", "text": text}]
            error = {"type": "mcp_tool_execution_error", "content": content}
            return {**done, "status": "failed", "error": error}
        return {**done, "output": text}
