"""Hosted tools served through an operator-configured MCP backend (web search, file
search, code interpreter): `[gateway.hosted_backends.<kind>]` in the gateway config.

    [gateway.hosted_backends.web_search]
    server_url = "http://127.0.0.1:9000/mcp"   # a streamable HTTP MCP server
    tool = "search"                              # the MCP tool called
    argument = "query"                           # its argument that gets the model's
                                                 # query (code for code_interpreter)
    # optional: description (what the model reads), headers, authorization

A request's tool of a backed type reaches the prompt as a one-argument function
(backend_tools.py); the model's call is the API's item (`web_search_call`, ...), shown in
progress while the gateway calls the MCP tool (hosted/mcp.py's StreamableHttpServers, a
session per call), then done with the result, which the model reads in the same
response. A backend that fails (down, timeout, the tool's own error) gives the item
status `failed` and the model the error as its result: never a failed response.
"""

import re
from collections.abc import Mapping

from once.gateway.hosted.backend_tools import (
    BACKEND_CALLS,
    BACKEND_KINDS,
    KIND_OF_TOOL,
    OUTPUT_FIELD,
    call_argument,
    declaration,
)
from once.gateway.hosted.base import HostedOutcome, HostedTurn
from once.gateway.hosted.mcp import McpFailure, McpServers, StreamableHttpServers
from once.protocol.responses import ResponsesRequest

BACKEND_KEYS = ("server_url", "tool", "argument", "description", "headers", "authorization")
SOURCES_INCLUDE = "web_search_call.action.sources"
URL = re.compile(r"https?://[^\s<>\"')\]]+")


def parse_backends(table: Mapping) -> dict[str, dict]:
    """The config's table, checked: backend key -> its settings (ValueError naming the key)."""
    backends: dict[str, dict] = {}
    for key, settings in table.items():
        where = f"hosted_backends.{key}"
        if key not in BACKEND_KINDS:
            raise ValueError(f"{where}: no such hosted tool (one of {sorted(BACKEND_KINDS)})")
        if not isinstance(settings, Mapping):
            raise ValueError(f"{where} must be a table")
        unknown = sorted(set(settings) - set(BACKEND_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}")
        for required in ("server_url", "tool"):
            if not isinstance(settings.get(required), str) or not settings[required]:
                raise ValueError(f"{where}.{required} must be a non-empty string")
        backends[key] = {"argument": BACKEND_KINDS[key][2], **settings}
    return backends


class HostedBackends:
    """The hosted tool behind every backed tool type."""

    def __init__(self, backends: Mapping[str, dict], servers: McpServers | None = None):
        self.backends = parse_backends(backends)
        self.servers = servers or StreamableHttpServers()
        self.tool_types = tuple(t for key in self.backends for t in BACKEND_KINDS[key][0])

    def backed(self, request: ResponsesRequest) -> list[str]:
        """The backend keys the request's tools ask for, in the order declared."""
        keys = [KIND_OF_TOOL.get(str(t.get("type"))) for t in request.tools]
        return list(dict.fromkeys(k for k in keys if k in self.backends))

    def prompt_functions(self, request: ResponsesRequest) -> list[dict]:
        return [declaration(k, self.backends[k].get("description")) for k in self.backed(request)]

    def handles(self, item: dict, request: ResponsesRequest) -> bool:
        return BACKEND_CALLS.get(item["type"]) in self.backed(request)

    def opens(self, request: ResponsesRequest) -> bool:
        return False

    async def open(self, turn: HostedTurn) -> HostedOutcome | None:
        return None

    async def run(self, call: dict, turn: HostedTurn) -> HostedOutcome:
        backend = self.backends[BACKEND_CALLS[call["type"]]]
        _, value = call_argument(call)
        failed = False
        if not value:
            text, failed = f"error: the call needs its '{backend['argument']}'", True
        else:
            try:
                text, failed = await self.servers.call_tool(
                    backend, backend["tool"], {backend["argument"]: value}
                )
            except McpFailure as e:
                text, failed = f"error: {e}", True
            else:
                text = f"error: {text}" if failed else text
        done = {**call, "status": "failed" if failed else "completed", OUTPUT_FIELD: text}
        return HostedOutcome([self._native_fields(done, text, failed, turn.request)])

    def _native_fields(self, item: dict, text: str, failed: bool, request) -> dict:
        """The SDK's own result fields, as the API fills them (`include` asks for some)."""
        kind = item["type"]
        if kind == "web_search_call" and SOURCES_INCLUDE in request.include and not failed:
            urls = list(dict.fromkeys(URL.findall(text)))
            sources = [{"type": "url", "url": url} for url in urls]
            return {**item, "action": {**item["action"], "sources": sources}}
        if kind == "file_search_call":
            results = [{"text": text}] if not failed else None
            return {**item, "results": results}
        if kind == "code_interpreter_call":
            return {**item, "outputs": [{"type": "logs", "logs": text}]}
        return item
