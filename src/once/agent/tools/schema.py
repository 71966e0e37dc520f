"""Schema compression to a token budget, and the token counts it is measured with.

A tool definition the model sees may carry a smaller schema than the tool has: the
registry validates every call against the *full* schema and sends the full schema back
with the error when a call fails, so compression trades a rare retry for prompt tokens.

`compress_schema` applies stages in order and stops at the first result within budget:

    1. drop annotations (title, examples, $comment, readOnly, a 2020-12 $schema, ...)
    2. shorten descriptions to their first sentence
    3. strip descriptions
    4. drop $defs / definitions ($ref -> any)
    5. collapse objects and arrays deeper than 2, then deeper than 1, to their type
    6. prune anyOf / oneOf / allOf (a union of plain types becomes a type list)
    7. drop bounds and formats (minimum, maxLength, pattern, default, ...)
    8. drop long enums (> 8 values), then every enum
    9. collapse every property to its type, then drop optional properties

Every stage only removes constraints or replaces a subschema by a looser one, so the
result is a valid JSON Schema that accepts every input the full one accepts. Enums and
bounds are what the model needs to call correctly and are cheap, so they go last.
Property names are data, not keywords: a property called `title` is never stripped.
"""

import copy
import functools
import math
import re
from collections.abc import Callable

from once.protocol.responses import canonical_json

TokenCounter = Callable[[str], int]

# `$schema` goes only when it names 2020-12, the default: another draft reads the rest
# differently (draft-07's tuple `items` is invalid under 2020-12).
_ANNOTATIONS: tuple[str, ...] = ("title", "examples", "$comment", "readOnly", "writeOnly")
_ANNOTATIONS += ("deprecated", "markdownDescription")
_BOUNDS: tuple[str, ...] = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_BOUNDS += ("multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems")
_BOUNDS += ("uniqueItems", "minProperties", "maxProperties", "default", "additionalProperties")
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_LONG_ENUM = 8
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE: tuple[str, ...] = ("items", "additionalProperties", "contains", "not", "if", "then", "else")
_ONE += ("propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def estimate_tokens(text: str) -> int:
    """Tokenizer-agnostic: 4 ASCII characters a token, one per other character (CJK
    text costs about that in BPE vocabularies). On the 644 catalog definitions it
    gives 0.91x SmolLM2's total (0.5x-1.4x per definition)."""
    non_ascii = sum(1 for c in text if ord(c) > 127)
    return math.ceil((len(text) - non_ascii) / 4 + non_ascii)


@functools.cache
def smollm2_token_counter() -> TokenCounter:
    """The default model's tokenizer (`tokenizer.json` of the converted SmolLM2)."""
    from tokenizers import Tokenizer

    from once.model_files import DEFAULT_MODEL, find_model_folder

    tokenizer = Tokenizer.from_file(str(find_model_folder(DEFAULT_MODEL) / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def schema_tokens(schema: dict, count_tokens: TokenCounter = estimate_tokens) -> int:
    return count_tokens(canonical_json(schema))


def map_subschemas(schema, fn: Callable[[dict, int], dict], depth: int = 0):
    """Apply `fn(subschema, depth)` bottom-up to every subschema; returns a new schema.
    Depth grows by one through `properties` / `items` (the nesting a model sees)."""
    if not isinstance(schema, dict):
        return schema  # booleans and malformed values stay as they are
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = map_subschemas(out[key], fn, depth + (key == "items"))
        elif key == "items" and isinstance(out.get(key), list):  # draft-07 tuple form
            out[key] = [map_subschemas(s, fn, depth + 1) for s in out[key]]
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [map_subschemas(s, fn, depth + (key == "prefixItems")) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            step = key in ("properties", "patternProperties")
            out[key] = {n: map_subschemas(s, fn, depth + step) for n, s in out[key].items()}
    return fn(out, depth)


def _without(keys: tuple[str, ...]) -> Callable[[dict, int], dict]:
    return lambda s, depth: {k: v for k, v in s.items() if k not in keys}


def _drop_annotations(s: dict, depth: int) -> dict:
    s = {k: v for k, v in s.items() if k not in _ANNOTATIONS}
    if "json-schema.org/draft/2020-12/" in str(s.get("$schema", "")):
        del s["$schema"]
    return s


def _first_sentence(s: dict, depth: int) -> dict:
    text = s.get("description")
    if not isinstance(text, str):
        return s
    short = re.split(r"(?<=[.!?。])\s", text.strip(), maxsplit=1)[0]
    return {**s, "description": short[:120]}


def _drop_refs(s: dict, depth: int) -> dict:
    s = {k: v for k, v in s.items() if k not in ("$defs", "definitions")}
    s.pop("$ref", None)  # what it pointed at is gone: the subschema accepts anything
    return s


def _collapse_below(max_depth: int) -> Callable[[dict, int], dict]:
    def collapse(s: dict, depth: int) -> dict:
        if depth <= max_depth:
            return s
        return {k: s[k] for k in ("type", "enum") if k in s}

    return collapse


def _prune_combinators(s: dict, depth: int) -> dict:
    out = {k: v for k, v in s.items() if k not in _COMBINATORS}
    branches = s.get("anyOf") or s.get("oneOf")
    # A union of bare types ({"type": "string"} | {"type": "null"}) keeps its meaning.
    if branches and "type" not in out and all(_bare_type(b) for b in branches):
        types = sorted({t for b in branches for t in _type_list(b["type"])})
        out["type"] = types[0] if len(types) == 1 else types
    return out


def _bare_type(branch) -> bool:
    return isinstance(branch, dict) and set(branch) == {"type"}


def _type_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _drop_long_enums(s: dict, depth: int) -> dict:
    enum = s.get("enum")
    if isinstance(enum, list) and len(enum) > _LONG_ENUM:
        return {k: v for k, v in s.items() if k != "enum"}
    return s


def _types_only(s: dict, depth: int) -> dict:
    return s if depth == 0 else {k: s[k] for k in ("type",) if k in s}


def _required_only(schema: dict) -> dict:
    required = [r for r in schema.get("required") or () if isinstance(r, str)]
    properties = schema.get("properties") or {}
    kept = {name: properties[name] for name in required if name in properties}
    if "properties" not in schema:
        return schema
    return {**schema, "properties": kept}


def _stages() -> list[Callable[[dict], dict]]:
    def each(fn):
        return lambda schema: map_subschemas(schema, fn)

    return [
        each(_drop_annotations),
        each(_first_sentence),
        each(_without(("description",))),
        each(_drop_refs),
        each(_collapse_below(2)),
        each(_collapse_below(1)),
        each(_prune_combinators),
        each(_without(_BOUNDS)),
        each(_drop_long_enums),
        each(_without(("enum", "const"))),
        each(_types_only),
        _required_only,
    ]


def compress_schema(
    schema: dict, budget_tokens: int, count_tokens: TokenCounter = estimate_tokens
) -> dict:
    """The least-compressed form of `schema` within `budget_tokens` (of its canonical
    JSON), or the most compressed form when none fits. The input is not modified."""
    current = copy.deepcopy(schema)
    if schema_tokens(current, count_tokens) <= budget_tokens:
        return current
    for stage in _stages():
        current = stage(current)
        if schema_tokens(current, count_tokens) <= budget_tokens:
            break
    return current
