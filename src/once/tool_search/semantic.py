"""Sentence-embedding scores and their fusion with BM25, the hybrid ranker's half.

The embedding model is not imported here: an `Embedder` is any callable from texts to
unit vectors, one row per text (the gateway's all-MiniLM-L6-v2 `SentenceEmbedder.
embed_texts` from the engine layer, which imports torch; `HashedWordEmbedder` in tests).
So this package stays torch-free and the caller decides whether a model loads at all.

Fusion is reciprocal rank fusion: each ranking gives a tool weight / (k + rank), rank
from 0; BM25's ranking holds only the tools that match a term, the embedding's holds all.
Ranks, not scores: BM25 scores grow with the query's length and cosines do not, so a
weighted sum of the raw scores would need a per-query normalization (min-max and
z-scores were no better on the tuning part). k and the weights: DESIGN.md.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from once.tool_search.documents import ToolDoc, embedding_text, terms

# texts -> (len(texts), dim) float array of unit rows
Embedder = Callable[[list[str]], np.ndarray]


class SemanticScorer:
    """`scores(query)`: the cosine of the query's embedding with each doc's."""

    def __init__(self, docs: Sequence[ToolDoc], embedder: Embedder):
        self.embedder = embedder
        texts = [embedding_text(doc) for doc in docs]
        self._vectors = np.asarray(embedder(texts), dtype=np.float32) if texts else None

    def scores(self, query: str) -> np.ndarray:
        if self._vectors is None:
            return np.zeros(0, dtype=np.float32)
        query_vector = np.asarray(self.embedder([query]), dtype=np.float32)[0]  # (dim,)
        return self._vectors @ query_vector  # (num_docs,)


def reciprocal_rank_fusion(
    rankings: Sequence[tuple[np.ndarray, float]], num_docs: int, k: float
) -> np.ndarray:
    """`rankings`: (doc indexes best first, weight) pairs -> one fused score per doc."""
    fused = np.zeros(num_docs)
    for order, weight in rankings:
        fused[order] += weight / (k + np.arange(len(order)))
    return fused


class EmbeddingCache:
    """An `Embedder` that embeds each distinct text once (least recently used first out):
    a gateway sees the same deferred tools request after request."""

    def __init__(self, embedder: Embedder, max_entries: int = 10_000):
        self.embedder = embedder
        self.max_entries = max_entries
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()

    def __call__(self, texts: list[str]) -> np.ndarray:
        missing = [text for text in dict.fromkeys(texts) if text not in self._vectors]
        if missing:
            for text, vector in zip(missing, np.asarray(self.embedder(missing)), strict=True):
                self._vectors[text] = vector
        rows = []
        for text in texts:
            self._vectors.move_to_end(text)
            rows.append(self._vectors[text])
        while len(self._vectors) > self.max_entries:
            self._vectors.popitem(last=False)
        return np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)


class HashedWordEmbedder:
    """A model-free `Embedder` for tests: each search term hashed to one of `dim`
    dimensions, counts normalized. Texts sharing terms are near; synonyms are not."""

    def __init__(self, dim: int = 256):
        self.dim = dim

    def __call__(self, texts: list[str]) -> np.ndarray:
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in terms(text):
                digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
                vectors[row, int.from_bytes(digest, "little") % self.dim] += 1.0
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)
