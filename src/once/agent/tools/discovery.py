"""Deferred tool discovery: what goes into the request's `tools`, and how more arrive.

When every tool definition inline (core tools + the whole catalog) costs more than an
absolute token threshold, the request carries only the core tools plus `tool_search`.
The model calls `tool_search`; the harness answers with a `tool_search_output` item at
the tail of the conversation holding the matched definitions (schemas compressed to a
budget), which the gateway renders where it occurs. The `tools` field is fixed for the
whole session, so the prompt head never changes and the WebSocket chain continues;
calls to any catalog tool are validated by the registry against the full schema.

Tokens are always counted the same way: `canonical_json(spec.to_function_tool())` of
each tool, summed, through one `TokenCounter`.

The loop's side, in short:

    discovery = DeferredTools(core_specs, catalog)
    request["tools"] = discovery.request_tools()          # never changes afterwards
    for tool in discovery.tools(): registry.register(tool)  # tool_search when deferred
    catalog.register_into(registry)
    ...
    result = await registry.call(call["name"], call["arguments"], ctx)
    if call["name"] == TOOL_SEARCH_NAME:
        item = discovery.output_item(call["call_id"], result)  # tool_search_output
"""

from collections.abc import Sequence
from dataclasses import dataclass

from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.catalog import ToolCatalog
from once.agent.tools.schema import TokenCounter, compress_schema, estimate_tokens
from once.protocol.responses import FUNCTION_CALL_OUTPUT, TOOL_SEARCH_OUTPUT, canonical_json
from once.tool_search import DEFAULT_LIMIT, SELECT_PREFIX

TOOL_SEARCH_NAME = "tool_search"
DEFAULT_DEFER_THRESHOLD_TOKENS = 4_000  # all definitions inline above this: defer
DEFAULT_TOOL_BUDGET_TOKENS = 400  # one discovered definition, schema compressed to fit
MAX_SEARCH_LIMIT = 20

TOOL_SEARCH_SPEC = ToolSpec(
    name=TOOL_SEARCH_NAME,
    description=(
        "Find and load tools from the catalog; their definitions are added to the "
        "conversation and can be called next. query: what the tool must do, a tool name "
        f"(server.tool or a bare name), or {SELECT_PREFIX}name1,name2 to load exactly those."
    ),
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_LIMIT},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
)


def sorted_specs(specs: Sequence[ToolSpec]) -> list[ToolSpec]:
    return sorted(specs, key=lambda s: (s.namespace, s.name))


def definitions_tokens(tools: Sequence[dict], count_tokens: TokenCounter) -> int:
    return sum(count_tokens(canonical_json(tool)) for tool in tools)


def compressed_function_tool(
    spec: ToolSpec, budget_tokens: int, count_tokens: TokenCounter = estimate_tokens
) -> dict:
    """`spec` as a function tool of at most ~`budget_tokens`: the description stays (the
    model chooses by it), the schema is compressed into what is left."""
    base = count_tokens(canonical_json(spec.to_function_tool({})))
    parameters = compress_schema(spec.parameters, max(budget_tokens - base, 16), count_tokens)
    return spec.to_function_tool(parameters)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]  # the request's `tools`, fixed for the session
    deferred: bool
    tokens: int  # of `tools`
    inline_tokens: int  # of every tool inline: what deferring is measured against


def plan_tools(
    core: Sequence[ToolSpec],
    catalog: Sequence[ToolSpec],
    *,
    threshold_tokens: int = DEFAULT_DEFER_THRESHOLD_TOKENS,
    count_tokens: TokenCounter = estimate_tokens,
) -> ToolPlan:
    inline = tuple(s.to_function_tool() for s in sorted_specs([*core, *catalog]))
    inline_tokens = definitions_tokens(inline, count_tokens)
    if inline_tokens <= threshold_tokens:
        return ToolPlan(inline, False, inline_tokens, inline_tokens)
    deferred = tuple(s.to_function_tool() for s in sorted_specs([*core, TOOL_SEARCH_SPEC]))
    return ToolPlan(deferred, True, definitions_tokens(deferred, count_tokens), inline_tokens)


def deferred_prompt_fraction(
    core: Sequence[ToolSpec],
    catalog: Sequence[ToolSpec],
    count_tokens: TokenCounter = estimate_tokens,
) -> float:
    """Tokens of the first request's tools when deferred / with every tool inline."""
    plan = plan_tools(core, catalog, threshold_tokens=0, count_tokens=count_tokens)
    return plan.tokens / plan.inline_tokens


def tool_search_output_item(call_id: str | None, tools: Sequence[dict]) -> dict:
    return {
        "type": TOOL_SEARCH_OUTPUT,
        "call_id": call_id,
        "execution": "client",
        "status": "completed",
        "tools": list(tools),
    }


class ToolSearchTool:
    """The `tool_search` tool. Its result carries the matched definitions (compressed) in
    `metadata["tools"]`; a definition already loaded in this session is not sent again."""

    spec = TOOL_SEARCH_SPEC

    def __init__(
        self,
        catalog: ToolCatalog,
        *,
        budget_tokens: int = DEFAULT_TOOL_BUDGET_TOKENS,
        count_tokens: TokenCounter = estimate_tokens,
    ):
        self.catalog = catalog
        self.budget_tokens = budget_tokens
        self.count_tokens = count_tokens
        self.loaded: dict[str, dict] = {}  # function name -> definition sent, in load order

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        query = str(args.get("query", "")).strip()
        limit = min(int(args.get("limit") or DEFAULT_LIMIT), MAX_SEARCH_LIMIT)
        unknown: list[str] = []
        if query.lower().startswith(SELECT_PREFIX):
            selection = self.catalog.index().select(query[len(SELECT_PREFIX) :])
            specs, unknown = selection.tools, selection.unknown
        else:
            specs = self.catalog.search(query, limit)
        if not specs:
            missing = f"unknown tools: {', '.join(unknown)}" if unknown else "no tool matches"
            return ToolResult(f"{missing} ({query!r}); try other words", True)
        fresh = [s for s in specs if s.function_name not in self.loaded]
        tools = [compressed_function_tool(s, self.budget_tokens, self.count_tokens) for s in fresh]
        for spec, tool in zip(fresh, tools, strict=True):
            self.loaded[spec.function_name] = tool
        lines = [f"loaded: {', '.join(s.function_name for s in fresh)}"] if fresh else []
        again = [s.function_name for s in specs if s not in fresh]
        lines += [f"already loaded: {', '.join(again)}"] if again else []
        lines += [f"unknown tools: {', '.join(unknown)}"] if unknown else []
        return ToolResult("\n".join(lines), False, {"tools": tools})


class DeferredTools:
    """The deferred-tools policy of one session: the fixed request tools, the
    `tool_search` tool when deferring, and the items its results become."""

    def __init__(
        self,
        core: Sequence[ToolSpec],
        catalog: ToolCatalog,
        *,
        threshold_tokens: int = DEFAULT_DEFER_THRESHOLD_TOKENS,
        budget_tokens: int = DEFAULT_TOOL_BUDGET_TOKENS,
        count_tokens: TokenCounter = estimate_tokens,
    ):
        self.catalog = catalog
        self.plan = plan_tools(
            core, catalog.specs(), threshold_tokens=threshold_tokens, count_tokens=count_tokens
        )
        self.search_tool = ToolSearchTool(
            catalog, budget_tokens=budget_tokens, count_tokens=count_tokens
        )

    @property
    def deferred(self) -> bool:
        return self.plan.deferred

    def request_tools(self) -> list[dict]:
        return list(self.plan.tools)

    def tools(self) -> list[ToolSearchTool]:
        """Tools the harness must register beside the core ones."""
        return [self.search_tool] if self.deferred else []

    def loaded_tools(self) -> list[dict]:
        """Definitions loaded so far (compaction carries them into the new chain)."""
        return list(self.search_tool.loaded.values())

    def output_item(self, call_id: str | None, result: ToolResult) -> dict:
        """The item that answers a `tool_search` call: `tool_search_output` with the
        loaded definitions, or a `function_call_output` when the model must read text
        (no match, unknown names, bad arguments, nothing new). The call id is echoed as the
        model sent it (None if it sent none)."""
        if result.is_error or not result.metadata.get("tools"):
            return {"type": FUNCTION_CALL_OUTPUT, "call_id": call_id, "output": result.output}
        return tool_search_output_item(call_id, result.metadata["tools"])
