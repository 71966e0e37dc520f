"""`tool_search` over the catalog: BM25 (`bm25s`) with exact-name and prefix boosts.

Default ranker, in order:

1. `select:a,b` returns exactly the named tools, in the order given (see `select`).
2. Boost tiers, highest first; within a tier, BM25 score then (namespace, name):
   - 4: the query is a tool's namespaced name (`server.tool` or `server__tool`): always
     first, whatever BM25 thinks;
   - 3: the query is a bare tool name: every server's tool of that name;
   - 2: an identifier in the query (`use read_file to ...`; one with `_`, `-`, `.` or
     camelCase, so that plain words such as "fetch" stay text) is a tool's name;
   - 1: a one-word query of 3+ characters is a prefix of a namespaced or bare name
     (`github.list_`, `osm-mcp`).
3. BM25 over a field-weighted document per tool: name and namespace split on `_`, `-`,
   `.` and camelCase (namespace counted twice: it names the service, which task text
   often names too), description, parameter names and their descriptions; lowercased,
   English stop words and request words ("please", "help") dropped, Snowball-stemmed.
   CJK text (61 LiveMCPBench descriptions are Chinese) is also indexed as character
   bigrams in a second index, used only for a query with CJK in it: in the main index
   the bigrams would lengthen those documents and push their tools down for English.
4. Typed-entity query expansion: a file path in the task means file tools ("file path
   directory"), a relative time ("tomorrow", "latest") means the current date ("current
   date time"), "save"/"store" means "write". Agent tasks leave these needs implicit,
   and tool descriptions never use the task's words for them.

`plain` is the baseline the bar names: BM25 over name + description + parameter names
with bm25s's own tokenizer and English stop words, no boosts.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

import bm25s
import numpy as np
from bm25s.stopwords import STOPWORDS_EN_PLUS

from once.agent.tools.base import NAMESPACE_SEPARATOR, ToolSpec

try:  # bm25s's recommended stemmer; without it recall@5 drops by ~0.015
    import Stemmer

    _STEMMER = Stemmer.Stemmer("english")
except ImportError:  # pragma: no cover - PyStemmer is a dependency
    _STEMMER = None

SELECT_PREFIX = "select:"
DEFAULT_LIMIT = 5
RANKERS = ("default", "plain")

# Words that ask for help rather than say what is needed.
_REQUEST_WORDS = {"please", "help", "want", "need", "like", "could", "would", "tell", "give"}
_REQUEST_WORDS |= {"show", "let", "also", "using", "use", "make", "can"}
STOP_WORDS = frozenset(STOPWORDS_EN_PLUS) | _REQUEST_WORDS

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD = re.compile(r"\w+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]+")
_IDENTIFIER = re.compile(r"[A-Za-z0-9][\w.\-]*[A-Za-z0-9]")

_PATH = re.compile(r"(?:^|[\s'\"(])(?:~|\.{1,2})?/[\w.\-]+(?:/[\w.\-]*)*")
_RELATIVE_TIME = re.compile(
    r"\b(today|tomorrow|yesterday|tonight|now|current|currently|latest|recent|recently"
    r"|(?:this|next|last) (?:week|month|year|\w+day)|past \w+|last \d+\s*\w+)\b",
    re.IGNORECASE,
)
_SAVE = re.compile(r"\b(save|saved|saving|store|stored)\b", re.IGNORECASE)


def split_identifier(text: str) -> str:
    """`getBaziDetail` -> `get Bazi Detail`; `get-weread_rank.v2` -> `get weread rank v2`."""
    return re.sub(r"[_\-.]+", " ", _CAMEL.sub(" ", text))


def terms(text: str) -> list[str]:
    """Search terms of any text: identifiers split, stop words out, stemmed. A run of
    CJK characters stays one word here; `cjk_terms` gives its bigrams."""
    words = [
        word
        for word in _WORD.findall(split_identifier(text).lower())
        if word not in STOP_WORDS and (len(word) > 1 or not word.isascii())
    ]
    return _STEMMER.stemWords(words) if _STEMMER is not None else words


def cjk_terms(text: str) -> list[str]:
    """Character bigrams of the CJK runs in `text` (Chinese has no spaces between words)."""
    return [run[i : i + 2] for run in _CJK.findall(text) for i in range(max(1, len(run) - 1))]


def expand_query(query: str) -> str:
    extra = []
    if _PATH.search(query):
        extra.append("file path directory")
    if _RELATIVE_TIME.search(query):
        extra.append("current date time")
    if _SAVE.search(query):
        extra.append("write")
    return " ".join([query, *extra])


def tool_document(spec: ToolSpec) -> list[str]:
    properties = spec.parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    described = [p.get("description") for p in properties.values() if isinstance(p, dict)]
    return (
        terms(spec.name)
        + terms(spec.namespace) * 2
        + terms(spec.description)
        + terms(" ".join(properties))
        + terms(" ".join(d for d in described if isinstance(d, str)))
    )


def plain_document(spec: ToolSpec) -> str:
    properties = spec.parameters.get("properties")
    names = " ".join(properties) if isinstance(properties, dict) else ""
    return f"{spec.name} {spec.description} {names}"


def _bm25_scores(bm25: bm25s.BM25, words: list[str], num_docs: int) -> np.ndarray:
    words = [w for w in words if w in bm25.vocab_dict]
    if not words:
        return np.zeros(num_docs, dtype=np.float32)
    return bm25.get_scores(words)


@dataclass(frozen=True)
class Selection:
    specs: list[ToolSpec]
    unknown: list[str]


class ToolSearchIndex:
    """An index over fixed specs; build a new one when the catalog changes."""

    def __init__(self, specs: Sequence[ToolSpec], ranker: str = "default"):
        if ranker not in RANKERS:
            raise ValueError(f"unknown ranker {ranker!r}; one of {', '.join(RANKERS)}")
        self.ranker = ranker
        self.specs = sorted(specs, key=lambda s: (s.namespace, s.name))
        self._sort_key = np.arange(len(self.specs))  # position in (namespace, name) order
        self._bm25 = bm25s.BM25()
        if ranker == "plain":
            corpus = [plain_document(s) for s in self.specs]
            tokens = bm25s.tokenize(corpus, stopwords="en", show_progress=False)
        else:
            tokens = [tool_document(s) or [""] for s in self.specs]
        if self.specs:
            self._bm25.index(tokens, show_progress=False)
        self._cjk_bm25: bm25s.BM25 | None = None
        cjk = [cjk_terms(f"{s.description} {plain_document(s)}") for s in self.specs]
        if ranker == "default" and any(cjk):
            self._cjk_bm25 = bm25s.BM25()
            self._cjk_bm25.index([words or [""] for words in cjk], show_progress=False)
        self._by_qualified: dict[str, int] = {}
        self._by_bare: dict[str, list[int]] = {}
        for i, spec in enumerate(self.specs):
            for name in (spec.display_name, spec.function_name):
                self._by_qualified.setdefault(name, i)
                self._by_qualified.setdefault(name.lower(), i)
            self._by_bare.setdefault(spec.name.lower(), []).append(i)

    def __len__(self) -> int:
        return len(self.specs)

    def search(self, query: str, limit: int = DEFAULT_LIMIT) -> list[ToolSpec]:
        """The best `limit` tools for `query`; only tools that match at all."""
        query = query.strip()
        if query.lower().startswith(SELECT_PREFIX):
            return self.select(query[len(SELECT_PREFIX) :]).specs[:limit]
        return [self.specs[i] for i in self.ranking(query)[:limit]]

    def ranking(self, query: str) -> list[int]:
        """Indexes into `self.specs` of every matching tool, best first."""
        if not self.specs or not query.strip():
            return []
        scores = self._scores(query)
        tiers = self._tiers(query) if self.ranker == "default" else np.zeros(len(self.specs))
        matched = np.flatnonzero((scores > 0) | (tiers > 0))
        # lexsort: the last key is the primary one.
        order = np.lexsort((self._sort_key[matched], -scores[matched], -tiers[matched]))
        return [int(i) for i in matched[order]]

    def _scores(self, query: str) -> np.ndarray:
        if self.ranker == "plain":
            words = bm25s.tokenize(query, stopwords="en", return_ids=False, show_progress=False)
            words = words[0]
        else:
            words = terms(expand_query(query))
        scores = _bm25_scores(self._bm25, words, len(self.specs))
        if self._cjk_bm25 is not None and _CJK.search(query):
            scores = scores + _bm25_scores(self._cjk_bm25, cjk_terms(query), len(self.specs))
        return scores

    def _tiers(self, query: str) -> np.ndarray:
        tiers = np.zeros(len(self.specs), dtype=np.int8)
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
            for i, spec in enumerate(self.specs):  # tier 1: a prefix of a name
                names = (spec.display_name.lower(), spec.function_name.lower(), spec.name.lower())
                if tiers[i] < 1 and any(n.startswith(key) for n in names):
                    tiers[i] = 1
        for i in self._by_bare.get(key, ()):
            tiers[i] = 3
        exact = self._by_qualified.get(text, self._by_qualified.get(key))
        if exact is not None and (NAMESPACE_SEPARATOR in key or "." in key):
            tiers[exact] = 4
        return tiers

    def select(self, names: str | Sequence[str]) -> Selection:
        """Exactly the named tools, in the order named; a bare name shared by several
        servers selects each of them (by namespace). Deterministic: no scoring."""
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
        return Selection([self.specs[i] for i in chosen], unknown)
