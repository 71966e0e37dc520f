"""Input safety classifiers that run while the engine prefills.

The gateway starts `SafetyChecker.check` together with dispatch to the engine, on the new
items of a request only, so the check hides behind prefill. Two classifiers ship:

- `RuleClassifier`: case-insensitive regexes per category plus a deny-list of literal
  phrases. Microseconds; runs inline on the event loop.
- `EmbeddingClassifier`: nearest-exemplar classification with all-MiniLM-L6-v2. Text is cut
  into chunks of a few sentences, every chunk is embedded in one pass, and each chunk takes
  the label of its single nearest exemplar (`safety_exemplars`) by cosine. The input is
  flagged when some chunk's nearest exemplar is unsafe with similarity >= threshold.
  Bounded: at most `max_chars_per_text` of each text and `max_tokens` word pieces per
  check, so a check costs at most ~0.5 s on one core (~0.09 s for 200 tokens of text).

The model itself is a `SentenceEmbedder` from the engine layer (the only one that imports
torch), handed in by the wiring (`cli.py`). It runs in one dedicated worker thread whose
own OpenMP team is limited to one core, so a check occupies at most one core beside the
engine's step loop, and checks queue behind each other instead of multiplying contention.
"""

import asyncio
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from once.gateway.safety.exemplars import BENIGN, DEFAULT_THRESHOLD, EXEMPLARS

POLICIES = ("stream", "hold")
MODEL_MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length, [CLS] and [SEP] included

# Sentence ends and line breaks: where a text is cut into segments.
_SEGMENT_BREAK = re.compile(r"(?<=[.!?;])\s+|\n+")
_HAS_WORD = re.compile(r"[^\W\d_]{2}")


@dataclass(frozen=True)
class SafetyVerdict:
    flagged: bool
    category: str | None  # None when not flagged
    score: float  # confidence for `category` (cosine for the embedding classifier)
    classifier: str  # which classifier decided
    elapsed_s: float  # wall time of the check


def _since(start: float) -> float:
    return time.perf_counter() - start


class InputClassifier(Protocol):
    name: str

    async def classify(self, texts: Sequence[str]) -> SafetyVerdict: ...


Bounded = TypeVar("Bounded", str, list)


def keep_ends(items: Bounded, limit: int) -> Bounded:
    # A harmful instruction sits at either end of a pasted blob ("do X with this: <blob>",
    # "<blob> now do X"), so bounding keeps the first quarter and the last three quarters.
    if len(items) <= limit:
        return items
    num_head = limit // 4
    return items[:num_head] + items[len(items) - (limit - num_head) :]


def keep_ends_within(items: list, costs: list[int], budget: int) -> list:
    """`keep_ends` by cost: a quarter of the budget from the front, the rest from the back."""
    if sum(costs) <= budget:
        return items
    head, spent = 0, 0
    while head < len(items) and spent + costs[head] <= budget // 4:
        spent += costs[head]
        head += 1
    tail = len(items)
    while tail > head and spent + costs[tail - 1] <= budget:
        spent += costs[tail - 1]
        tail -= 1
    return items[:head] + items[tail:]


def split_into_chunks(text: str, chunk_words: int) -> list[str]:
    """Sentences and lines, packed greedily into chunks of at most `chunk_words` words.

    A sentence alone loses its context ("Write a program. It should encrypt the victim's
    files."); a whole text dilutes one harmful sentence in a page of code. A few sentences
    stay near the exemplars' length. Longer segments are cut into word windows; segments
    with no word (braces, numbers) are dropped. 40 words fit well in 256 word pieces.
    """
    chunks: list[str] = []
    current: list[str] = []
    for segment in _SEGMENT_BREAK.split(text):
        if not _HAS_WORD.search(segment):
            continue
        words = segment.split()
        for begin in range(0, len(words), chunk_words):
            window = words[begin : begin + chunk_words]
            if len(current) + len(window) > chunk_words:
                chunks.append(" ".join(current))
                current = []
            current.extend(window)
    if current:
        chunks.append(" ".join(current))
    return chunks


class RuleClassifier:
    name = "rules"
    DENY_LIST_CATEGORY = "deny_list"

    def __init__(
        self,
        rules: Mapping[str, Sequence[str]] | None = None,
        deny_list: Sequence[str] = (),
    ):
        self.patterns: list[tuple[str, re.Pattern]] = []
        if rules is not None and not isinstance(rules, Mapping):
            raise ValueError(f"safety rules must map category -> [regex, ...], got {rules!r}")
        if isinstance(deny_list, str) or not all(isinstance(p, str) for p in deny_list):
            raise ValueError(f"safety deny_list must be a list of phrases, got {deny_list!r}")
        for category, regexes in (rules or {}).items():
            if isinstance(regexes, str):
                raise ValueError(f"safety rules for {category!r} must be a list of regexes")
            for regex in regexes:
                try:
                    self.patterns.append((category, re.compile(regex, re.IGNORECASE)))
                except (re.error, TypeError) as error:
                    raise ValueError(
                        f"bad safety rule regex {regex!r} for category {category!r}: {error}"
                    ) from None
        phrases = [phrase for phrase in deny_list if phrase.strip()]
        if phrases:
            alternation = "|".join(re.escape(phrase) for phrase in phrases)
            self.patterns.append((self.DENY_LIST_CATEGORY, re.compile(alternation, re.I)))
        if not self.patterns:
            raise ValueError("the rules classifier needs at least one rule or deny-list phrase")

    async def classify(self, texts: Sequence[str]) -> SafetyVerdict:
        start = time.perf_counter()
        for text in texts:
            for category, pattern in self.patterns:
                if pattern.search(text):
                    return SafetyVerdict(True, category, 1.0, self.name, _since(start))
        return SafetyVerdict(False, None, 0.0, self.name, _since(start))


class Embedder(Protocol):
    """What the embedding classifier needs (engine.embedding.SentenceEmbedder)."""

    def load(self) -> None: ...

    def tokenize(self, sentences: list[str]) -> list[list[int]]: ...

    def embed(self, token_ids: list[list[int]]) -> Any: ...  # (n, hidden) unit rows


class EmbeddingClassifier:
    name = "embedding"

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        embedder: Embedder,
        exemplars: Mapping[str, Sequence[str]] = EXEMPLARS,
        chunk_words: int = 40,
        max_chars_per_text: int = 4000,
        max_tokens: int = 1024,
        worker_initializer=None,
    ):
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise ValueError(f"safety threshold must be a number, got {threshold!r}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"safety threshold must be in (0, 1], got {threshold!r}")
        sizes = {"chunk_words": chunk_words, "max_chars_per_text": max_chars_per_text}
        for key, value in {**sizes, "max_tokens": max_tokens}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"safety {key} must be a positive integer, got {value!r}")
        if max_tokens < MODEL_MAX_TOKENS:
            raise ValueError(f"safety max_tokens must be >= {MODEL_MAX_TOKENS} (one chunk)")
        if not any(label != BENIGN and sentences for label, sentences in exemplars.items()):
            raise ValueError("the embedding classifier needs unsafe exemplars")
        self.threshold = float(threshold)
        self.chunk_words = chunk_words
        self.max_chars_per_text = max_chars_per_text
        self.max_tokens = max_tokens
        self.embedder = embedder
        self._exemplars = {label: tuple(sentences) for label, sentences in exemplars.items()}
        # Everything below belongs to the worker thread: loaded, and only used, there.
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="once-safety", initializer=worker_initializer
        )
        self._loaded = False
        self._exemplar_labels: list[str] = []
        self._exemplar_embeddings: Any = None  # (num_exemplars, 384), unit rows
        self._exemplar_is_unsafe: Any = None  # (num_exemplars,) bool
        self.load_time_s: float | None = None

    def warm_up(self) -> None:
        self._executor.submit(self._load).result()

    async def classify(self, texts: Sequence[str]) -> SafetyVerdict:
        start = time.perf_counter()
        if not any(text.strip() for text in texts):
            return SafetyVerdict(False, None, 0.0, self.name, _since(start))
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, self._classify_in_worker, list(texts))
        category, score = await work
        return SafetyVerdict(category is not None, category, score, self.name, _since(start))

    def chunks(self, texts: Sequence[str]) -> list[str]:
        bounded = [keep_ends(text, self.max_chars_per_text) for text in texts]
        return [chunk for text in bounded for chunk in split_into_chunks(text, self.chunk_words)]

    # -- worker thread ---------------------------------------------------------------------

    def _load(self) -> None:
        if self._loaded:
            return
        start = time.perf_counter()
        import numpy as np

        self.embedder.load()
        self._exemplar_labels = [
            label for label, sentences in self._exemplars.items() for _ in sentences
        ]
        sentences = [sentence for group in self._exemplars.values() for sentence in group]
        self._exemplar_embeddings = self.embedder.embed(self.embedder.tokenize(sentences))
        self._exemplar_is_unsafe = np.array([label != BENIGN for label in self._exemplar_labels])
        self.load_time_s = time.perf_counter() - start
        self._loaded = True

    def _classify_in_worker(self, texts: list[str]) -> tuple[str | None, float]:
        """(category, cosine) of the most similar chunk whose nearest exemplar is unsafe.

        When no chunk is flagged the score is the highest cosine to any unsafe exemplar: how
        close the input came.
        """
        self._load()
        chunk_ids = self.embedder.tokenize(self.chunks(texts))
        # Cost is linear in word pieces, so the bound is a budget of them, spent on both ends.
        chunk_ids = keep_ends_within(chunk_ids, [len(ids) for ids in chunk_ids], self.max_tokens)
        if not chunk_ids:  # no words at all
            return None, 0.0
        similarities = self.embedder.embed(chunk_ids) @ self._exemplar_embeddings.T
        nearest = similarities.argmax(axis=1)  # (chunks,)
        nearest_score = similarities.max(axis=1)  # (chunks,)
        flagged = self._exemplar_is_unsafe[nearest] & (nearest_score >= self.threshold)
        if not flagged.any():
            return None, float(similarities[:, self._exemplar_is_unsafe].max())
        chunk = int((nearest_score * flagged).argmax())
        return self._exemplar_labels[nearest[chunk]], float(nearest_score[chunk])


class SafetyChecker:
    """Runs every classifier concurrently; the first flagged verdict wins.

    `policy` is stored for the response pipeline: "stream" streams at once and cuts the
    response when the check fails; "hold" buffers output until the check passes. A
    classifier that raises fails the check loudly: a safety check is never passed by error.
    """

    def __init__(
        self,
        classifiers: Sequence[InputClassifier],
        policy: Literal["stream", "hold"] = "stream",
    ):
        if policy not in POLICIES:
            raise ValueError(f"safety policy must be one of {POLICIES}, got {policy!r}")
        if not classifiers:
            raise ValueError("a safety checker needs at least one classifier")
        self.classifiers = list(classifiers)
        self.policy = policy

    def warm_up(self) -> None:
        for classifier in self.classifiers:
            warm_up = getattr(classifier, "warm_up", None)
            if warm_up is not None:
                warm_up()

    async def check(self, texts: Sequence[str]) -> SafetyVerdict:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(c.classify(texts)) for c in self.classifiers]
        verdicts: list[SafetyVerdict] = []
        try:
            for next_done in asyncio.as_completed(tasks):
                verdict = await next_done
                if verdict.flagged:
                    return verdict
                verdicts.append(verdict)
        finally:
            # After a flagged verdict or an error, stop waiting on the rest (a thread already
            # running a model finishes its batch; its result is dropped).
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # mark a second failure as seen, not "never retrieved"
        return SafetyVerdict(
            flagged=False,
            category=None,
            score=max(verdict.score for verdict in verdicts),
            classifier="+".join(classifier.name for classifier in self.classifiers),
            elapsed_s=max(time.perf_counter() - start, *(v.elapsed_s for v in verdicts)),
        )


CLASSIFIER_NAMES = ("embedding", "rules")
EMBEDDING_KEYS = ("threshold", "max_chars_per_text", "max_tokens")
CONFIG_KEYS = ("policy", "classifiers", "rules", "deny_list", *EMBEDDING_KEYS)


def build_safety_checker(
    config: Mapping | None, *, embedder_factory=None, worker_initializer=None
) -> SafetyChecker | None:
    """A checker from one model's `[safety]` TOML table; None or {} means no safety check.

    `embedder_factory()` makes the embedding classifier's model (the wiring passes
    `engine.embedding.SentenceEmbedder`), `worker_initializer` runs in its worker thread.

    Keys: policy ("stream" | "hold"), classifiers (default ["embedding"]), threshold,
    max_chars_per_text, max_tokens (embedding), rules ({category: [regex, ...]}) and
    deny_list ([phrase, ...]) (rules). Unknown keys are errors, so a typo never silently
    turns a check off.
    """
    if not config:
        return None
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown safety config keys {unknown}; known: {list(CONFIG_KEYS)}")
    names = config.get("classifiers", ["embedding"])
    if isinstance(names, str) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"safety 'classifiers' must be a non-empty list, got {names!r}")
    for name in names:
        if name not in CLASSIFIER_NAMES:
            raise ValueError(f"unknown safety classifier {name!r}; known: {list(CLASSIFIER_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"safety classifiers are listed twice: {names!r}")
    if ("rules" in config or "deny_list" in config) and "rules" not in names:
        raise ValueError("safety 'rules'/'deny_list' are given but 'rules' is not a classifier")
    classifiers: list[InputClassifier] = []
    for name in names:
        if name == "embedding":
            if embedder_factory is None:
                raise ValueError("the embedding safety classifier needs an embedder")
            options = {key: config[key] for key in EMBEDDING_KEYS if key in config}
            classifiers.append(
                EmbeddingClassifier(
                    embedder=embedder_factory(), worker_initializer=worker_initializer, **options
                )
            )
        else:
            classifiers.append(
                RuleClassifier(config.get("rules"), deny_list=config.get("deny_list", ()))
            )
    return SafetyChecker(classifiers, policy=config.get("policy", "stream"))


async def time_standalone(checker: SafetyChecker, texts: Sequence[str], repeats: int = 5) -> float:
    """Median wall seconds of one check, models loaded beforehand (the benchmark's figure)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    await asyncio.to_thread(checker.warm_up)
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        await checker.check(texts)
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)
