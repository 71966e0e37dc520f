"""Tools the gateway runs itself, inside a response, as the Responses API's hosted tools.

A hosted tool's call ends a generation step early (generation.py); the pipeline hands the
call to the tool, emits the items it gives back (a `tool_search_output`, an MCP call's
result), and continues the same response: the next step's prompt is the conversation so
far, this step's output and the tool's items, rendered as a continuation of the step's
context (the prefix cache holds everything before them), so the model reads the
result and goes on. A response runs at most `MAX_HOSTED_CALLS` of them; past that a
hosted call stays unanswered in the output and the response completes.

`HostedTool` is the seam: one implementation per hosted tool type. `ToolSearch` serves
`tool_search` with server execution over the request's `defer_loading` tools, ranked by
an injected ranker (`Ranker`: the same one the harness's `tool_search` uses).
"""

from collections.abc import Callable, Sequence
from typing import Protocol

from once.protocol.responses import TOOL_SEARCH_CALL, TOOL_SEARCH_OUTPUT, ResponsesRequest

MAX_HOSTED_CALLS = 8
DEFAULT_SEARCH_LIMIT = 5

# (query, the searchable tools as Responses function-tool dicts, limit) -> the best first.
Ranker = Callable[[str, Sequence[dict], int], list[dict]]


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


def deferred_tools(tools: Sequence[dict]) -> list[tuple[str | None, dict]]:
    """(namespace or None, function tool) for every tool marked `defer_loading`."""
    found: list[tuple[str | None, dict]] = []
    for tool in tools:
        if tool.get("type") == "namespace":
            for nested in tool.get("tools") or ():
                if nested.get("defer_loading") or tool.get("defer_loading"):
                    found.append((tool["name"], nested))
        elif tool.get("type", "function") == "function" and tool.get("defer_loading"):
            found.append((None, tool))
    return found


class ToolSearch:
    """Server-side `tool_search`: the model's query against the deferred tools."""

    def __init__(self, ranker: Ranker, limit: int = DEFAULT_SEARCH_LIMIT):
        self.ranker = ranker
        self.limit = limit

    def handles(self, item: dict, request: ResponsesRequest) -> bool:
        return item["type"] == TOOL_SEARCH_CALL and item.get("execution") == "server"

    async def run(self, call: dict, request: ResponsesRequest) -> list[dict]:
        arguments = call.get("arguments") or {}
        query = str(arguments.get("query") or arguments.get("input") or "")
        limit = arguments.get("limit")
        limit = limit if isinstance(limit, int) and 0 < limit <= 20 else self.limit
        candidates = deferred_tools(request.tools)
        by_id = {id(tool): namespace for namespace, tool in candidates}
        best = self.ranker(query, [tool for _, tool in candidates], limit)
        return [
            {
                "type": TOOL_SEARCH_OUTPUT,
                "call_id": call["call_id"],
                "execution": "server",
                "status": "completed",
                "tools": _grouped(best, by_id, request.tools),
            }
        ]


def _grouped(best: list[dict], namespace_of: dict[int, str | None], tools: Sequence[dict]):
    """The found tools as the request declared them: a namespace's under that namespace."""
    namespaces = {t["name"]: t for t in tools if t.get("type") == "namespace"}
    out: list[dict] = []
    groups: dict[str, dict] = {}
    for tool in best:
        namespace = namespace_of.get(id(tool))
        if namespace is None:
            out.append(tool)
            continue
        if namespace not in groups:
            source = namespaces[namespace]
            groups[namespace] = {k: v for k, v in source.items() if k != "tools"} | {"tools": []}
            out.append(groups[namespace])
        groups[namespace]["tools"].append(tool)
    return out
