"""Tool search: which deferred tools answer a query, for the harness and the gateway.

The harness's `tool_search` over its MCP catalog (agent/tools/catalog.py adapts its
`ToolSpec`s) and the gateway's server-side `tool_search` over a request's deferred
Responses tools (`ToolIndex.from_response_tools`) rank with this one package. It imports
nothing from the layers that use it and no model: a sentence embedder for the hybrid
ranker is passed in as a callable.

    index = ToolIndex.from_response_tools(request_tools)   # BM25, no model
    tools = merge_namespaces(index.search("weather in Paris tomorrow", 5))

    index = ToolIndex(entries, ranker="hybrid", embedder=EmbeddingCache(embed_texts))
"""

from once.tool_search.documents import EXPANSION_RULES, ToolDoc, expand_query, split_identifier
from once.tool_search.index import (
    DEFAULT_LIMIT,
    DEFAULT_RANKER,
    RANKERS,
    SELECT_PREFIX,
    Selection,
    ToolIndex,
)
from once.tool_search.responses import merge_namespaces, response_tool_entries
from once.tool_search.semantic import Embedder, EmbeddingCache, HashedWordEmbedder

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_RANKER",
    "EXPANSION_RULES",
    "RANKERS",
    "SELECT_PREFIX",
    "Embedder",
    "EmbeddingCache",
    "HashedWordEmbedder",
    "Selection",
    "ToolDoc",
    "ToolIndex",
    "expand_query",
    "merge_namespaces",
    "response_tool_entries",
    "split_identifier",
]
