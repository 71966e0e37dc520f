"""What a tool is to the search, and the text each ranker reads of it.

`ToolDoc` is the neutral description the harness's `ToolSpec`s and the Responses API's
function tools both become. The ranker reads three texts of one:

- `bm25_terms`: a field-weighted bag of terms. Name and namespace split on `_`, `-`, `.`
  and camelCase (the namespace counted twice: it names the service, which task text
  often names too), the description, parameter names and their descriptions;
  lowercased, English stop words and request words ("please", "help") dropped,
  Snowball-stemmed.
- `cjk_terms`: character bigrams of the CJK runs (Chinese has no spaces between words).
- `embedding_text`: "namespace split name: description Parameters: a, b" for a sentence
  embedding (with the parameter names: chosen over the same text without them, and over
  the name alone, on the tuning part of LiveMCPBench; DESIGN.md).

Query expansion rules add words for needs agent tasks leave implicit and tool
descriptions never phrase the task's way: a file path means file tools, a relative time
("tomorrow", "latest") means the current date, "save"/"store" means "write". Which rules
each ranker uses was chosen on the tuning part only (DESIGN.md, the harness).
"""

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bm25s.stopwords import STOPWORDS_EN_PLUS

try:  # bm25s's recommended stemmer; without it recall@5 drops by ~0.015
    import Stemmer

    _STEMMER = Stemmer.Stemmer("english")
except ImportError:  # pragma: no cover - PyStemmer is a dependency
    _STEMMER = None

# A namespaced tool is found by "namespace.name" (how people and the gateway's models
# write it) and by "namespace__name" (the harness's function name: OpenAI function names
# allow only [A-Za-z0-9_-]).
QUALIFIED_SEPARATORS = (".", "__")


@dataclass(frozen=True)
class ToolDoc:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)  # JSON schema of the args
    namespace: str = ""  # the MCP server or Responses namespace; "" for a top-level tool

    def qualified_names(self) -> list[str]:
        if not self.namespace:
            return [self.name]
        return [f"{self.namespace}{separator}{self.name}" for separator in QUALIFIED_SEPARATORS]

    def parameter_names(self) -> list[str]:
        properties = self.parameters.get("properties")
        return list(properties) if isinstance(properties, dict) else []

    def parameter_descriptions(self) -> list[str]:
        properties = self.parameters.get("properties")
        values = properties.values() if isinstance(properties, dict) else ()
        described = (p.get("description") for p in values if isinstance(p, dict))
        return [d for d in described if isinstance(d, str)]


# Words that ask for help rather than say what is needed.
_REQUEST_WORDS = {"please", "help", "want", "need", "like", "could", "would", "tell", "give"}
_REQUEST_WORDS |= {"show", "let", "also", "using", "use", "make", "can"}
STOP_WORDS = frozenset(STOPWORDS_EN_PLUS) | _REQUEST_WORDS

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD = re.compile(r"\w+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]+")


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


def has_cjk(text: str) -> bool:
    return _CJK.search(text) is not None


def cjk_terms(text: str) -> list[str]:
    return [run[i : i + 2] for run in _CJK.findall(text) for i in range(max(1, len(run) - 1))]


def bm25_terms(doc: ToolDoc) -> list[str]:
    return (
        terms(doc.name)
        + terms(doc.namespace) * 2
        + terms(doc.description)
        + terms(" ".join(doc.parameter_names()))
        + terms(" ".join(doc.parameter_descriptions()))
    )


def plain_text(doc: ToolDoc) -> str:
    """The baseline's document: name, description and parameter names, as written."""
    return f"{doc.name} {doc.description} {' '.join(doc.parameter_names())}"


def embedding_text(doc: ToolDoc) -> str:
    parameters = ", ".join(split_identifier(name) for name in doc.parameter_names())
    head = f"{doc.namespace} {split_identifier(doc.name)}: {doc.description}"
    return f"{head} Parameters: {parameters}"  # the tuned text, even with no parameters


_PATH = re.compile(r"(?:^|[\s'\"(])(?:~|\.{1,2})?/[\w.\-]+(?:/[\w.\-]*)*")
_RELATIVE_TIME = re.compile(
    r"\b(today|tomorrow|yesterday|tonight|now|current|currently|latest|recent|recently"
    r"|(?:this|next|last) (?:week|month|year|\w+day)|past \w+|last \d+\s*\w+)\b",
    re.IGNORECASE,
)
_SAVE = re.compile(r"\b(save|saved|saving|store|stored)\b", re.IGNORECASE)

# name -> (what in the query triggers it, the words it adds)
EXPANSION_RULES: dict[str, tuple[re.Pattern[str], str]] = {
    "path": (_PATH, "file path directory"),
    "relative_time": (_RELATIVE_TIME, "current date time"),
    "save": (_SAVE, "write"),
}


def expand_query(query: str, rules: Iterable[str] = tuple(EXPANSION_RULES)) -> str:
    extra = [EXPANSION_RULES[rule][1] for rule in rules if EXPANSION_RULES[rule][0].search(query)]
    return " ".join([query, *extra])
