"""Tools the gateway runs itself, inside a response, as the Responses API's hosted tools.

A hosted tool's call ends a generation step early (generation.py); the pipeline hands the
call to the tool, emits the items it gives back (a `tool_search_output`, an MCP call's
result, a program's output), and continues the same response: the next step's prompt is
the conversation so far, this step's output and the tool's items, rendered as a
continuation of the step's context (the prefix cache holds everything before them), so
the model reads the result and goes on. A response runs at most `MAX_HOSTED_CALLS` of
them; past that a hosted call stays unanswered in the output and the response completes.

Two more ways a hosted tool shapes a response:

- it may *suspend* it (`HostedOutcome.suspend`): the response completes right after the
  tool's items, because the client must act first (a program waits on the client's
  functions, an MCP call waits for approval);
- a request may bring it work before any generation (`opens` / `open`): the outputs a
  suspended program waited for, an MCP approval, an MCP server whose tools the
  conversation has not listed yet. The pipeline runs this while preparing the response,
  so a request that cannot be resumed (a program whose code changed) is a 400 like any
  other refusal, and the first step's prompt holds what it produced.

`HostedTool` is the seam: one implementation per hosted tool type. `ToolSearch` serves
`tool_search` with server execution over the request's `defer_loading` tools, with the
ranker the harness's `tool_search` uses; programs.py serves `programmatic_tool_calling`,
hosted/mcp.py remote `mcp` servers.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class HostedTurn:
    """What a hosted tool sees of the response it works in."""

    request: ResponsesRequest
    items: Sequence[dict]  # the conversation before this response, the request's input last
    output: Sequence[dict] = ()  # this response's output so far

    def param_of(self, item: dict, field_name: str | None = None) -> str | None:
        """The request parameter that holds `item` (`input[3]`), None when an earlier
        response does: what a refusal names."""
        for index, candidate in enumerate(self.request.input_items):
            if candidate is item:
                return f"input[{index}]" + (f".{field_name}" if field_name else "")
        return None


@dataclass
class HostedOutcome:
    # Each a complete item, without an id where it is new (the builder gives one); an item
    # with the id of a call still in progress in the output finishes that call.
    items: list[dict] = field(default_factory=list)
    suspend: bool = False  # the response ends after these items: the client acts next


class HostedTool(Protocol):
    tool_types: tuple[str, ...]  # the request's tool types it serves (never "ignored")

    def handles(self, item: dict, request: ResponsesRequest) -> bool: ...

    async def run(self, call: dict, turn: HostedTurn) -> HostedOutcome: ...

    def opens(self, request: ResponsesRequest) -> bool:
        """Whether the request may bring this tool work before generation (cheap)."""
        ...

    async def open(self, turn: HostedTurn) -> HostedOutcome | None: ...

    def prompt_functions(self, request: ResponsesRequest) -> Sequence[dict]:
        """Function declarations the tool adds to the prompt beyond what render.py writes
        for the request's tools; most add none."""
        ...


class HostedTools:
    def __init__(self, tools: Sequence[HostedTool] = ()):
        self.tools = list(tools)
        self.tool_types = frozenset(kind for tool in self.tools for kind in tool.tool_types)

    def runs_here(self, request: ResponsesRequest) -> Callable[[dict], bool]:
        return lambda item: any(tool.handles(item, request) for tool in self.tools)

    async def run(self, call: dict, turn: HostedTurn) -> HostedOutcome:
        for tool in self.tools:
            if tool.handles(call, turn.request):
                return await tool.run(call, turn)
        raise ValueError(f"no hosted tool runs {call['type']!r}")

    def opens(self, request: ResponsesRequest) -> bool:
        return any(tool.opens(request) for tool in self.tools)

    def prompt_functions(self, request: ResponsesRequest) -> tuple[dict, ...]:
        """Declarations a tool adds to the prompt beyond what render.py writes for the
        request's tools (hosted/backends.py's one-argument functions)."""
        found: list[dict] = []
        for tool in self.tools:
            found.extend(tool.prompt_functions(request))
        return tuple(found)

    async def open(self, turn: HostedTurn) -> HostedOutcome | None:
        """Every tool's work before generation, in registration order, each seeing the
        items the ones before it produced."""
        items: list[dict] = []
        suspend = False
        for tool in self.tools:
            if not tool.opens(turn.request):
                continue
            outcome = await tool.open(HostedTurn(turn.request, turn.items, (*turn.output, *items)))
            if outcome is not None:
                items.extend(outcome.items)
                suspend = suspend or outcome.suspend
        return HostedOutcome(items, suspend) if items or suspend else None


class ToolSearch:
    """Server-side `tool_search`: the model's query against the request's deferred tools,
    ranked by the harness's own ranker (once.tool_search: BM25 with its boosts by default;
    `hybrid` with an embedder). Indexes are kept per tool list, the last few."""

    tool_types: tuple[str, ...] = ("tool_search",)

    def __init__(self, ranker: str = DEFAULT_RANKER, embedder: Embedder | None = None):
        self.ranker = ranker
        self.embedder = embedder
        self._indexes: OrderedDict[str, ToolIndex[dict]] = OrderedDict()

    def handles(self, item: dict, request: ResponsesRequest) -> bool:
        return item["type"] == TOOL_SEARCH_CALL and item.get("execution") == "server"

    def opens(self, request: ResponsesRequest) -> bool:
        return False

    async def open(self, turn: HostedTurn) -> HostedOutcome | None:
        return None

    def prompt_functions(self, request: ResponsesRequest) -> Sequence[dict]:
        return ()

    async def run(self, call: dict, turn: HostedTurn) -> HostedOutcome:
        request = turn.request
        arguments = call.get("arguments") or {}
        query = str(arguments.get("query") or arguments.get("input") or "")
        limit = arguments.get("limit")
        limit = limit if isinstance(limit, int) and 0 < limit <= 20 else DEFAULT_SEARCH_LIMIT
        found = self._index(request.tools).search(query, limit)
        output = {
            "type": TOOL_SEARCH_OUTPUT,
            "call_id": call["call_id"],
            "execution": "server",
            "status": "completed",
            "tools": merge_namespaces(found),
        }
        return HostedOutcome([output])

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
