"""Structured outputs: constraints compiled by llguidance, one matcher per request.

A constraint (`OutputConstraint`: a JSON schema, any JSON object, a Lark grammar or a
regex) is compiled into an llguidance `LLMatcher` once per distinct constraint and kept in
an LRU cache keyed by (kind, text); a request gets a `deep_copy` of that compiled matcher
(microseconds; the lexer and grammar tables are shared, not rebuilt). Compiling needs the
model's tokenizer as llguidance sees it (the bytes of every token id), which is built on
the first constrained request, not at engine start (about a second for a 49k vocabulary).

The request's matcher is advanced with every committed output id (`Request.append_output`)
and nothing else: a recompute after preemption prefills ids the matcher has consumed
already, and never reaches it. Once the grammar admits nothing more (`is_complete`), the
request stops: the only token it still allows is eos, so sampling it would spend a
forward to learn nothing.

JSON is compiled without free whitespace, with json.dumps's separators (", " and ": "):
allowed anywhere, whitespace is where a small model spends its token budget (runs of
newlines until max_tokens). A schema may override this through llguidance's own
`x-guidance` key (e.g. `{"x-guidance": {"whitespace_flexible": true}}`). Keywords
llguidance does not implement make the schema an error rather than silently unenforced.
"""

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance

from once.protocol.engine import OutputConstraint
from once.protocol.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_DEFAULTS: "JsonCompileOptions" = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT = {"type": "object"}
MAX_COMPILED_GRAMMARS = 256
# llguidance's default limits, but errors without the parser state and grammar dump: the
# message goes back to the caller and into logs.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)

TokenizerFactory = Callable[[], llguidance.LLTokenizer]


def grammar_source(constraint: OutputConstraint) -> str:
    """The llguidance grammar (its JSON form) for a constraint; compiled by LLMatcher."""
    if constraint.kind in ("json_schema", "json_object"):
        schema = json.loads(constraint.text) if constraint.kind == "json_schema" else None
        if schema is True or schema is None:
            schema = ANY_JSON_OBJECT if constraint.kind == "json_object" else {}
        if schema is False:
            raise InvalidRequestError(
                "the JSON schema `false` admits no output", param="constraint.text"
            )
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if constraint.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(constraint.text)
    if constraint.kind == "llguidance":
        return constraint.text
    return llguidance.LLMatcher.grammar_from_regex(constraint.text)


def tokenizer_from_model(
    folder: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> TokenizerFactory:
    """The engine's default: llguidance's tokenizer built from the model folder's own
    (HF fast) tokenizer, sized to the model's vocabulary (ids past the tokenizer's never
    pass a mask) and allowing the model's eos ids where the grammar may end."""

    def build() -> llguidance.LLTokenizer:
        import llguidance.hf

        from once.model_files import load_tokenizer

        hf_tokenizer = load_tokenizer(folder)
        eos = list(eos_token_ids) or hf_tokenizer.eos_token_id
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)

    return build


class RequestGrammar:
    """One request's matcher and how many output ids it has consumed."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.num_consumed = 0

    def accept(self, token_id: int) -> None:
        # A rejected id leaves the matcher in its error state; the next mask fill finds
        # it there and fails the request with the matcher's message (masks.py).
        self.matcher.consume_token(token_id)
        self.num_consumed += 1

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and admits no further token but eos."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the grammar matcher failed"


class GrammarCompiler:
    """Compiles constraints once each (LRU by (kind, text)); thread-safe, so callers may
    compile on their own thread before a request reaches the step loop."""

    def __init__(
        self, tokenizer_factory: TokenizerFactory, max_compiled: int = MAX_COMPILED_GRAMMARS
    ):
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._max_compiled = max_compiled
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations run (cache misses)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_factory()
            return self._tokenizer

    def compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """The compiled matcher of a constraint (never advanced: requests get copies).
        A constraint llguidance cannot compile is an InvalidRequestError."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        tokenizer = self.tokenizer
        try:
            source = grammar_source(constraint)
        except ValueError as exc:  # llguidance rejects a schema that is not an object
            raise InvalidRequestError(
                f"cannot compile the {constraint.kind} constraint: {exc}", param="constraint.text"
            ) from None
        # Outside the lock: llguidance drops the GIL while it builds the lexer (up to ~1 s
        # for a huge grammar), and other compiles should not wait for it. Two threads
        # compiling the same constraint at once both succeed; one copy is kept.
        compiled = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=LIMITS)
        if compiled.is_error():
            raise InvalidRequestError(
                f"cannot compile the {constraint.kind} constraint: {compiled.get_error()}",
                param="constraint.text",
            )
        with self._lock:
            self.num_compiled += 1
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self._max_compiled:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, constraint: OutputConstraint) -> RequestGrammar:
        return RequestGrammar(self.compile(constraint).deep_copy())
