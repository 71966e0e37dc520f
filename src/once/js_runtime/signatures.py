"""Tools as the functions a program calls: one compact TypeScript-like line per tool.

`tools.name({arg: type, opt?: type}) - summary`: the first sentence of the description,
nested objects past depth 2 shown as `object`, long enums cut with `...`, names that are
not identifiers as `tools["a-b"]`. Both Code Mode's `code` tool and the gateway's
`program` tool list their callable tools this way.
"""

import json
import re

_IDENTIFIER = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")
_SCALARS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}
_MAX_ENUM = 6
_MAX_SUMMARY_CHARS = 120


def tool_signature(function_name: str, description: str, parameters: object) -> str:
    ref = (
        f"tools.{function_name}"
        if _IDENTIFIER.match(function_name)
        else (f"tools[{json.dumps(function_name)}]")
    )
    params = isinstance(parameters, dict) and parameters.get("properties") and type_of(parameters)
    line = f"{ref}({params or ''})"
    summary = _summary(description)
    return f"{line} - {summary}" if summary else line


def _summary(description: str) -> str:
    first = description.strip().split("\n", 1)[0]
    first = re.split(r"(?<=\.)\s", first, maxsplit=1)[0]
    if len(first) > _MAX_SUMMARY_CHARS:
        first = first[: _MAX_SUMMARY_CHARS - 3].rstrip() + "..."
    return first


def type_of(schema: object, depth: int = 0) -> str:
    """A TypeScript-like type for a JSON schema, compact: nested objects past depth 2 are
    `object`, long enums end in `...`."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        values = [json.dumps(v) for v in schema["enum"][:_MAX_ENUM]]
        return "|".join(values) + ("|..." if len(schema["enum"]) > _MAX_ENUM else "")
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            options = dict.fromkeys(type_of(s, depth) for s in schema[key])
            return "|".join(options) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        # A type list of non-strings is malformed: those entries are skipped, not joined.
        return "|".join(_SCALARS.get(k, k) for k in kind if isinstance(k, str)) or "any"
    if kind == "array":
        item = type_of(schema.get("items", {}), depth + 1)
        return f"({item})[]" if "|" in item else f"{item}[]"
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties or depth >= 2:
            return "object"
        required = set(schema.get("required", ()))
        fields = []
        for name, sub in properties.items():
            key = name if _IDENTIFIER.match(name) else json.dumps(name)
            optional = "" if name in required else "?"
            fields.append(f"{key}{optional}: {type_of(sub, depth + 1)}")
        return "{" + ", ".join(fields) + "}"
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if kind == "null":
        return "null"
    return _SCALARS.get(kind, "any") if isinstance(kind, str) else "any"
