"""BM25 scores of every tool for a query (`bm25s`), the ranker's lexical half.

`Bm25Scorer` reads `documents.bm25_terms` of each tool. CJK text (61 LiveMCPBench
descriptions are Chinese) is also indexed as character bigrams in a second index, used
only for a query with CJK in it: in the main index the bigrams would lengthen those
documents and push their tools down for English queries.

`PlainScorer` is the baseline the harness's bar names: BM25 over name + description +
parameter names with bm25s's own tokenizer and English stop words, nothing else.
"""

from collections.abc import Iterable, Sequence

import bm25s
import numpy as np

from once.tool_search.documents import (
    ToolDoc,
    bm25_terms,
    cjk_terms,
    expand_query,
    has_cjk,
    plain_text,
    terms,
)


def _scores(bm25: bm25s.BM25, words: list[str], num_docs: int) -> np.ndarray:
    words = [w for w in words if w in bm25.vocab_dict]
    if not words:
        return np.zeros(num_docs, dtype=np.float32)
    return bm25.get_scores(words)


def _indexed(corpus_tokens: list[list[str]]) -> bm25s.BM25:
    bm25 = bm25s.BM25()
    bm25.index([words or [""] for words in corpus_tokens], show_progress=False)
    return bm25


class Bm25Scorer:
    """`scores(query)`: one BM25 score per doc, in the order given; 0 where no term matches.
    `expansions` names the `documents.EXPANSION_RULES` applied to each query."""

    def __init__(self, docs: Sequence[ToolDoc], expansions: Iterable[str] = ()):
        self.num_docs = len(docs)
        self.expansions = tuple(expansions)
        self._bm25 = _indexed([bm25_terms(doc) for doc in docs]) if docs else None
        cjk = [cjk_terms(f"{doc.description} {plain_text(doc)}") for doc in docs]
        self._cjk_bm25 = _indexed(cjk) if any(cjk) else None

    def query_terms(self, query: str) -> list[str]:
        return terms(expand_query(query, self.expansions))

    def scores(self, query: str) -> np.ndarray:
        if self._bm25 is None:
            return np.zeros(0, dtype=np.float32)
        scores = _scores(self._bm25, self.query_terms(query), self.num_docs)
        if self._cjk_bm25 is not None and has_cjk(query):
            scores = scores + _scores(self._cjk_bm25, cjk_terms(query), self.num_docs)
        return scores


class PlainScorer:
    def __init__(self, docs: Sequence[ToolDoc]):
        self.num_docs = len(docs)
        self._bm25: bm25s.BM25 | None = None
        if docs:
            corpus = [plain_text(doc) for doc in docs]
            self._bm25 = bm25s.BM25()
            self._bm25.index(
                bm25s.tokenize(corpus, stopwords="en", show_progress=False), show_progress=False
            )

    def query_terms(self, query: str) -> list[str]:
        tokens = bm25s.tokenize(query, stopwords="en", return_ids=False, show_progress=False)
        return list(tokens[0])

    def scores(self, query: str) -> np.ndarray:
        if self._bm25 is None:
            return np.zeros(0, dtype=np.float32)
        return _scores(self._bm25, self.query_terms(query), self.num_docs)
