"""What the model reads about Code Mode: the `code` tool's name, limits and description.

The description states the limits, then one compact line per tool function
(`tools.name({arg: type, opt?: type}) - summary`); it is fixed when the tool is built so
the prompt prefix stays stable. The runtime that enforces the limits is code_mode.py,
which imports this module (never the other way round).
"""

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from once.agent.tools.base import ToolSpec

CODE_TOOL_NAME = "code"


@dataclass(frozen=True)
class CodeModeLimits:
    timeout_s: float = 30.0  # wall time of the whole program, nested calls included
    max_heap_bytes: int = 64 << 20
    max_tool_calls: int = 200
    max_output_tokens: int = 2000

    def __post_init__(self):
        if self.timeout_s <= 0 or self.max_heap_bytes <= 0:
            raise ValueError("code mode limits must be positive")
        if self.max_tool_calls < 0 or self.max_output_tokens < 16:
            raise ValueError("max_tool_calls must be >= 0 and max_output_tokens >= 16")


_INTRO = (
    "Run a JavaScript program in a fresh V8 isolate: no file system, network, modules or "
    "require; {timeout:g} s and {heap:g} MiB limits. The code is the body of an async "
    "function: use await, and return a value or print(...)/console.log(...). Only what it "
    "prints and returns comes back (non-strings as JSON), capped to {tokens} tokens, so "
    "filter and summarize in the program. Every tool is an async function on `tools` that "
    "takes one arguments object and resolves to the tool's output string, or throws an "
    "Error whose message is the tool's error output. Run independent calls together with "
    "Promise.all. Tools:"
)
_IDENTIFIER = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")
_SCALARS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}
_MAX_ENUM = 6
_MAX_SUMMARY_CHARS = 120


def code_mode_tool_description(
    specs: Iterable[ToolSpec], limits: CodeModeLimits | None = None
) -> str:
    """What the model reads: how programs run, then one signature line per tool."""
    limits = limits or CodeModeLimits()
    intro = _INTRO.format(
        timeout=limits.timeout_s,
        heap=limits.max_heap_bytes / 2**20,
        tokens=limits.max_output_tokens,
    )
    lines = [intro]
    for spec in specs:
        if spec.function_name == CODE_TOOL_NAME:
            continue
        name = spec.function_name
        ref = f"tools.{name}" if _IDENTIFIER.match(name) else f"tools[{json.dumps(name)}]"
        params = spec.parameters.get("properties") and _type_of(spec.parameters)
        line = f"{ref}({params or ''})"
        summary = _summary(spec.description)
        lines.append(f"{line} - {summary}" if summary else line)
    return "\n".join(lines)


def _summary(description: str) -> str:
    first = description.strip().split("\n", 1)[0]
    first = re.split(r"(?<=\.)\s", first, maxsplit=1)[0]
    if len(first) > _MAX_SUMMARY_CHARS:
        first = first[: _MAX_SUMMARY_CHARS - 3].rstrip() + "..."
    return first


def _type_of(schema: object, depth: int = 0) -> str:
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
            options = dict.fromkeys(_type_of(s, depth) for s in schema[key])
            return "|".join(options) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        # A type list of non-strings is malformed: those entries are skipped, not joined.
        return "|".join(_SCALARS.get(k, k) for k in kind if isinstance(k, str)) or "any"
    if kind == "array":
        item = _type_of(schema.get("items", {}), depth + 1)
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
            fields.append(f"{key}{optional}: {_type_of(sub, depth + 1)}")
        return "{" + ", ".join(fields) + "}"
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if kind == "null":
        return "null"
    return _SCALARS.get(kind, "any") if isinstance(kind, str) else "any"
