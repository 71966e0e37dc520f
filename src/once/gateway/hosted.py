"""Tools the gateway runs itself, inside a response, as the Responses API's hosted tools.

A hosted tool's call ends a generation step early (generation.py); the pipeline hands the
call to the tool, emits the items it gives back (a `tool_search_output`, an MCP call's
result), and continues the same response: the next step's prompt is the conversation so
far, this step's output and the tool's items, rendered as a continuation of the step's
context (the prefix cache holds everything before them), so the model reads the
result and goes on. A response runs at most `MAX_HOSTED_CALLS` of them; past that a
hosted call stays unanswered in the output and the response completes.

`HostedTool` is the seam: one implementation per hosted tool type. `ToolSearch` serves
`tool_search` with server execution over the request's `defer_loading` tools, with the
ranker the harness's `tool_search` uses.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from once.protocol.responses import (
    TOOL_SEARCH_CALL,
    TOOL_SEARCH_OUTPUT,
    ResponsesRequest,
    canonical_json,
)
from once.tool_search import DEFAULT_RANKER, Embedder, ToolIndex, merge_namespaces

MAX_HOSTED_CALLS = 8
DEFAULT_SEARCH_LIMIT = 5
MAX_CACHED_INDEXES = 16


class HostedTool(Protocol):
    def handles(self, item: dict, request: ResponsesRequest) -> bool: ...

    async def run(self, call: dict, request: ResponsesRequest) -> list[dict]:
        """The items that answer the call (each without an id: the builder gives one)."""
        ...


class HostedTools:
    def __init__(self, tools: Sequence[HostedTool] = ()):
        self.tools = list(tools)

    def runs_here(self, request: ResponsesRequest) -> Callable[[dict], bool]:
        return lambda item: any(tool.handles(item, request) for tool in self.tools)

    async def run(self, call: dict, request: ResponsesRequest) -> list[dict]:
        for tool in self.tools:
            if tool.handles(call, request):
                return await tool.run(call, request)
        raise ValueError(f"no hosted tool runs {call['type']!r}")


class ToolSearch:
    """Server-side `tool_search`: the model's query against the request's deferred tools,
    ranked by the harness's own ranker (once.tool_search: BM25 with its boosts by default;
    `hybrid` with an embedder). Indexes are kept per tool list, the last few."""

    def __init__(self, ranker: str = DEFAULT_RANKER, embedder: Embedder | None = None):
        self.ranker = ranker
        self.embedder = embedder
        self._indexes: OrderedDict[str, ToolIndex[dict]] = OrderedDict()

    def handles(self, item: dict, request: ResponsesRequest) -> bool:
        return item["type"] == TOOL_SEARCH_CALL and item.get("execution") == "server"

    async def run(self, call: dict, request: ResponsesRequest) -> list[dict]:
        arguments = call.get("arguments") or {}
        query = str(arguments.get("query") or arguments.get("input") or "")
        limit = arguments.get("limit")
        limit = limit if isinstance(limit, int) and 0 < limit <= 20 else DEFAULT_SEARCH_LIMIT
        found = self._index(request.tools).search(query, limit)
        return [
            {
                "type": TOOL_SEARCH_OUTPUT,
                "call_id": call["call_id"],
                "execution": "server",
                "status": "completed",
                "tools": merge_namespaces(found),
            }
        ]

    def _index(self, tools: Sequence[dict]) -> "ToolIndex[dict]":
        key = canonical_json(list(tools))
        index = self._indexes.get(key)
        if index is None:
            index = ToolIndex.from_response_tools(tools, ranker=self.ranker, embedder=self.embedder)
            self._indexes[key] = index
            while len(self._indexes) > MAX_CACHED_INDEXES:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(key)
        return index
