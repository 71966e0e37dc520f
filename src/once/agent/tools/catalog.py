"""The tool catalog: every discovered tool (MCP servers, hundreds of tools), one order.

The catalog is what `tool_search` searches and what the registry validates calls against;
the prompt carries only what discovery decides (see discovery.py). Tools are kept sorted
by (namespace, name), so the order servers were registered or answered in never shows.

The search is `once.tool_search`'s, whose ranker the gateway's server-side `tool_search`
uses too; `spec_index` says what a `ToolSpec` is to it, and its answers are the specs.
Without an embedder the catalog ranks with BM25 alone; given one, `ranker="hybrid"`
fuses in a sentence embedding (DESIGN.md, the harness, has what each gives).
"""

from collections.abc import Iterable

import jsonschema

from once.agent.tools.base import Tool, ToolContext, ToolResult, ToolSpec
from once.agent.tools.registry import ToolRegistry
from once.tool_search import DEFAULT_LIMIT, DEFAULT_RANKER, Embedder, ToolDoc, ToolIndex


def tool_doc(spec: ToolSpec) -> ToolDoc:
    return ToolDoc(spec.name, spec.description, spec.parameters, spec.namespace)


def spec_index(
    specs: Iterable[ToolSpec], ranker: str = DEFAULT_RANKER, embedder: Embedder | None = None
) -> ToolIndex[ToolSpec]:
    return ToolIndex([(tool_doc(spec), spec) for spec in specs], ranker=ranker, embedder=embedder)


class ToolCatalog:
    def __init__(
        self,
        tools: Iterable[Tool] = (),
        *,
        ranker: str = DEFAULT_RANKER,
        embedder: Embedder | None = None,
    ):
        self._tools: dict[str, Tool] = {}
        self._display: dict[str, str] = {}  # "server.tool" -> "server__tool"
        self.ranker = ranker
        self.embedder = embedder
        self._indexes: dict[str, ToolIndex[ToolSpec]] = {}
        for tool in tools:
            self.add(tool)

    @classmethod
    def from_specs(
        cls,
        specs: Iterable[ToolSpec],
        *,
        ranker: str = DEFAULT_RANKER,
        embedder: Embedder | None = None,
    ) -> "ToolCatalog":
        """A catalog of definitions only (benchmarks, tests): calls return an error."""
        return cls((UnconnectedTool(spec) for spec in specs), ranker=ranker, embedder=embedder)

    def add(self, tool: Tool) -> None:
        name = tool.spec.function_name
        if name in self._tools:
            raise ValueError(f"tool {tool.spec.display_name!r} is in the catalog twice")
        self._tools[name] = tool
        self._display[tool.spec.display_name] = name
        self._indexes.clear()

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def get(self, name: str) -> Tool | None:
        """By function name (`server__tool`) or display name (`server.tool`)."""
        return self._tools.get(name) or self._tools.get(self._display.get(name, ""))

    def tools(self) -> list[Tool]:
        return sorted(self._tools.values(), key=lambda t: (t.spec.namespace, t.spec.name))

    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self.tools()]

    def index(self, ranker: str | None = None) -> ToolIndex[ToolSpec]:
        """The search index (the catalog's ranker unless named), built on first use and
        again after the catalog changes."""
        ranker = ranker or self.ranker
        if ranker not in self._indexes:
            self._indexes[ranker] = spec_index(self.specs(), ranker, self.embedder)
        return self._indexes[ranker]

    def search(self, query: str, limit: int = DEFAULT_LIMIT) -> list[ToolSpec]:
        return self.index().search(query, limit)

    def register_into(self, registry: ToolRegistry) -> list[str]:
        """Put every tool into a `ToolRegistry`, so any call is validated against its full
        schema, whether or not its definition was ever shown to the model. Returns the
        tools the registry refused, with why: a server may publish a schema that is not
        valid JSON Schema (LiveMCPBench's pdf-reader-mcp.read_pdf has draft-04's boolean
        `exclusiveMinimum`), and one bad server must not stop the session."""
        refused = []
        for tool in self.tools():
            if tool.spec.function_name in registry:
                continue
            try:
                registry.register(tool)
            except (jsonschema.SchemaError, ValueError) as e:
                reason = getattr(e, "message", str(e))
                refused.append(f"{tool.spec.display_name}: {reason}")
        return refused


class UnconnectedTool:
    """A definition without a server behind it."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        return ToolResult(f"{self.spec.display_name} has no server connected", True)
