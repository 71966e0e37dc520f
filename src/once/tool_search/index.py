"""`ToolIndex`: the tools that answer a `tool_search` query, best first.

One index serves the harness (over its `ToolSpec`s) and the gateway (over a request's
deferred Responses tools): entries are `(ToolDoc, payload)` pairs and every answer is
payloads, so each caller gets back its own objects. Tools are kept in (namespace, name)
order, so the order they were registered or declared in never shows.

Rankers:

- "bm25" (the default; no model): the ranking below with BM25 scores (lexical.py) and
  every query expansion rule;
- "hybrid": the same with BM25's ranking fused with a sentence embedding's by reciprocal
  rank fusion (semantic.py), only the path expansion rule; needs an `Embedder`;
- "plain": the baseline, BM25 over name + description + parameter names, no boosts.

bm25 and hybrid, in order:

1. `select:a,b` returns exactly the named tools, in the order given (see `select`).
2. Boost tiers, highest first; within a tier, the ranker's score then (namespace, name):
   - 4: the query is a tool's namespaced name (`server.tool` or `server__tool`): always
     first, whatever the score says;
   - 3: the query is a bare tool name: every namespace's tool of that name;
   - 2: an identifier in the query (`use read_file to ...`; one with `_`, `-`, `.` or
     camelCase, so that plain words such as "fetch" stay text) is a tool's name;
   - 1: a one-word query of 3+ characters is a prefix of a namespaced or bare name
     (`github.list_`, `osm-mcp`).
3. Below the tiers, bm25 returns only tools that match a query term; hybrid ranks every
   tool once the query has a search term (the embedding finds a nearest tool for any).
"""

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from once.tool_search.documents import QUALIFIED_SEPARATORS, ToolDoc, has_cjk, split_identifier
from once.tool_search.lexical import Bm25Scorer, PlainScorer
from once.tool_search.responses import response_tool_entries
from once.tool_search.semantic import Embedder, SemanticScorer, reciprocal_rank_fusion

T = TypeVar("T")

SELECT_PREFIX = "select:"
DEFAULT_LIMIT = 5
RANKERS = ("bm25", "hybrid", "plain")
DEFAULT_RANKER = "bm25"
# The expansion rules (documents.EXPANSION_RULES) each ranker keeps, chosen on the tuning
# part of LiveMCPBench: removing any rule lowered bm25's recall there; in the hybrid only
# the path rule raised it (the other two changed nothing, so they are left out).
RANKER_EXPANSIONS = {"bm25": ("path", "relative_time", "save"), "hybrid": ("path",), "plain": ()}
# Reciprocal rank fusion: score = sum of weight / (HYBRID_RRF_K + rank); chosen on the
# tuning part (DESIGN.md), where k 30 and equal weights sat in a flat region.
HYBRID_RRF_K = 30
HYBRID_EMBEDDING_WEIGHT = 0.5

_IDENTIFIER = re.compile(r"[A-Za-z0-9][\w.\-]*[A-Za-z0-9]")


@dataclass(frozen=True)
class Selection(Generic[T]):
    tools: list[T]
    unknown: list[str]


class ToolIndex(Generic[T]):
    """An index over fixed tools; build a new one when the tools change."""

    def __init__(
        self,
        entries: Iterable[tuple[ToolDoc, T]],
        *,
        ranker: str = DEFAULT_RANKER,
        embedder: Embedder | None = None,
    ):
        if ranker not in RANKERS:
            raise ValueError(f"unknown ranker {ranker!r}; one of {', '.join(RANKERS)}")
        if ranker == "hybrid" and embedder is None:
            raise ValueError("the hybrid ranker needs an embedder (texts -> unit vectors)")
        self.ranker = ranker
        ordered = sorted(entries, key=lambda entry: (entry[0].namespace, entry[0].name))
        self.docs = [doc for doc, _ in ordered]
        self.tools = [tool for _, tool in ordered]
        self._lexical: Bm25Scorer | PlainScorer = (
            PlainScorer(self.docs)
            if ranker == "plain"
            else Bm25Scorer(self.docs, RANKER_EXPANSIONS[ranker])
        )
        self._semantic: SemanticScorer | None = None
        if ranker == "hybrid" and embedder is not None:
            self._semantic = SemanticScorer(self.docs, embedder)
        self._by_qualified: dict[str, int] = {}
        self._by_bare: dict[str, list[int]] = {}
        self._names_lower: list[list[str]] = []
        for i, doc in enumerate(self.docs):
            for name in doc.qualified_names():
                self._by_qualified.setdefault(name, i)
                self._by_qualified.setdefault(name.lower(), i)
            self._by_bare.setdefault(doc.name.lower(), []).append(i)
            self._names_lower.append([n.lower() for n in [*doc.qualified_names(), doc.name]])

    @classmethod
    def from_docs(
        cls,
        docs: Iterable[ToolDoc],
        *,
        ranker: str = DEFAULT_RANKER,
        embedder: Embedder | None = None,
    ) -> "ToolIndex[ToolDoc]":
        return ToolIndex([(doc, doc) for doc in docs], ranker=ranker, embedder=embedder)

    @classmethod
    def from_response_tools(
        cls,
        tools: Iterable[Mapping],
        *,
        deferred_only: bool = True,
        ranker: str = DEFAULT_RANKER,
        embedder: Embedder | None = None,
    ) -> "ToolIndex[dict]":
        """Over a request's deferred `function` tools and `namespace` functions; each
        answer is the tool dict to load (see responses.py, and `merge_namespaces`)."""
        entries = response_tool_entries(tools, deferred_only=deferred_only)
        return ToolIndex(entries, ranker=ranker, embedder=embedder)

    def __len__(self) -> int:
        return len(self.docs)

    def search(self, query: str, limit: int = DEFAULT_LIMIT) -> list[T]:
        """The best `limit` tools for `query` (or the `select:` list)."""
        query = query.strip()
        if query.lower().startswith(SELECT_PREFIX):
            return self.select(query[len(SELECT_PREFIX) :]).tools[:limit]
        return [self.tools[i] for i in self.ranking(query)[:limit]]

    def ranking(self, query: str) -> list[int]:
        """Indexes into `self.docs` / `self.tools` of every matching tool, best first."""
        if not self.docs or not query.strip():
            return []
        scores = self._lexical.scores(query)
        if self.ranker == "plain":
            tiers = np.zeros(len(self.docs), dtype=np.int8)
        else:
            tiers = self._tiers(query)
        if self._semantic is not None and (self._lexical.query_terms(query) or has_cjk(query)):
            scores = self._fused(scores, self._semantic.scores(query))
        matched = np.flatnonzero((scores > 0) | (tiers > 0))
        # lexsort: the last key is the primary one; docs are in (namespace, name) order.
        order = np.lexsort((matched, -scores[matched], -tiers[matched]))
        return [int(i) for i in matched[order]]

    def _fused(self, lexical: np.ndarray, cosine: np.ndarray) -> np.ndarray:
        lexical_order = np.lexsort((np.arange(len(lexical)), -lexical))
        lexical_order = lexical_order[lexical[lexical_order] > 0]  # matching tools only
        semantic_order = np.argsort(-cosine, kind="stable")
        weight = HYBRID_EMBEDDING_WEIGHT
        rankings = [(lexical_order, 1 - weight), (semantic_order, weight)]
        return reciprocal_rank_fusion(rankings, len(lexical), HYBRID_RRF_K)

    def _tiers(self, query: str) -> np.ndarray:
        tiers = np.zeros(len(self.docs), dtype=np.int8)
        text = query.strip().strip("`'\"")
        key = text.lower()
        for word in _IDENTIFIER.findall(text):  # tier 2: a tool named inside the query
            if split_identifier(word) == word:
                continue  # a plain word ("fetch", "search") is text, not a name
            for i in self._by_bare.get(word.lower(), ()):
                tiers[i] = 2
            if (qualified := self._by_qualified.get(word.lower())) is not None:
                tiers[qualified] = 2
        if len(key) >= 3 and not any(c.isspace() for c in key):
            for i, names in enumerate(self._names_lower):  # tier 1: a prefix of a name
                if tiers[i] < 1 and any(name.startswith(key) for name in names):
                    tiers[i] = 1
        for i in self._by_bare.get(key, ()):
            tiers[i] = 3
        exact = self._by_qualified.get(text, self._by_qualified.get(key))
        if exact is not None and any(separator in key for separator in QUALIFIED_SEPARATORS):
            tiers[exact] = 4
        return tiers

    def select(self, names: str | Sequence[str]) -> Selection[T]:
        """Exactly the named tools, in the order named; a bare name shared by several
        namespaces selects each of them (by namespace). Deterministic: no scoring."""
        if isinstance(names, str):
            names = names.split(",")
        chosen: list[int] = []
        unknown: list[str] = []
        for raw in names:
            name = raw.strip().strip("`'\"")
            if not name:
                continue
            hits = [self._by_qualified[name]] if name in self._by_qualified else []
            hits = hits or self._by_bare.get(name.lower(), [])
            if not hits and name.lower() in self._by_qualified:
                hits = [self._by_qualified[name.lower()]]
            if not hits:
                unknown.append(name)
            chosen.extend(i for i in hits if i not in chosen)
        return Selection([self.tools[i] for i in chosen], unknown)
