"""What the engine must constrain a response's output to, from the request.

Two things constrain an output, enforced by the engine's grammar matcher (llguidance,
engine/grammar.py), and carried to it as `SamplingParams.constraint`:

- a `tool_choice` that forces a call (`required`, a named function or custom tool, or
  `allowed_tools` in `required` mode): the output is one `<tool_call>` block, as the
  prompt asks the model to write it (tool_items.py), naming one of the tools it may call.
  A strict function's arguments follow its parameters schema; any other function's are
  a JSON object; a custom tool's input is a JSON string;
- a JSON text format (`text.format` `json_schema` or `json_object`; Chat Completions'
  `response_format`; Messages' `output_config.format`): the output is that JSON.

A forced call wins over a text format (the output is a call, not text). Forced outputs
of a replay bypass any constraint in the engine.
"""

import json
from collections.abc import Sequence

from once.gateway.program_tool import PROGRAM_TOOL_NAME, PROGRAM_TOOL_TYPE, allows
from once.gateway.tool_items import NAMESPACE_SEPARATOR, is_tool_search
from once.protocol.engine import OutputConstraint
from once.protocol.errors import InvalidRequestError
from once.protocol.responses import ADDITIONAL_TOOLS, ResponsesRequest

CALL_GRAMMAR = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '


def callable_tools(tools: Sequence[dict], items: Sequence[dict] = ()) -> dict[str, dict]:
    """Every tool the model may call, by the name it calls it: namespaces spelled out, the
    `program` tool of programmatic tool calling, not the tools only a program may call."""
    listed = list(tools)
    for item in items:
        if item.get("type") == ADDITIONAL_TOOLS:
            listed.extend(item.get("tools") or ())
    callable_: dict[str, dict] = {}
    for tool in listed:
        kind = tool.get("type", "function")
        if not allows(tool, "direct"):
            continue
        if kind == "namespace":
            for nested in tool.get("tools") or ():
                if allows(nested, "direct", tool):
                    callable_[f"{tool['name']}{NAMESPACE_SEPARATOR}{nested['name']}"] = nested
        elif kind in ("function", "custom"):
            callable_[tool["name"]] = tool
        elif kind == PROGRAM_TOOL_TYPE:
            callable_[PROGRAM_TOOL_NAME] = {"type": "custom", "name": PROGRAM_TOOL_NAME}
        elif is_tool_search(tool):
            callable_["tool_search"] = {"type": "function", "name": "tool_search"}
    return callable_


def forced_names(choice: object, callable_: dict[str, dict]) -> list[str] | None:
    """The tools a `tool_choice` forces one call of (None: it forces none). Raises for a
    name the request does not declare."""
    if choice == "required":
        return sorted(callable_)
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind in ("function", "custom"):
        names = [str(choice.get("name"))]
    elif kind == "allowed_tools":
        if choice.get("mode") != "required":
            return None
        names = [str(t.get("name")) for t in choice.get("tools") or ()]
    else:
        return None
    unknown = [name for name in names if name not in callable_]
    if unknown:
        raise InvalidRequestError(
            f"tool_choice names {unknown[0]!r}, which is not among the request's tools",
            param="tool_choice",
        )
    return names


def _call_schema(name: str, tool: dict) -> dict:
    if tool.get("type") == "custom":
        payload = {"input": {"type": "string"}}
    elif tool.get("strict") and tool.get("parameters"):
        payload = {"arguments": tool["parameters"]}
    else:
        payload = {"arguments": {"type": "object"}}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, **payload},
        "required": ["name", *payload],
        "additionalProperties": False,
    }


def output_constraint(request: ResponsesRequest, items: Sequence[dict]) -> OutputConstraint | None:
    callable_ = callable_tools(request.tools, items)
    names = forced_names(request.tool_choice, callable_)
    if names:
        schemas = [_call_schema(name, callable_[name]) for name in names]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return OutputConstraint("lark", CALL_GRAMMAR + json.dumps(schema))
    spec = request.text_format_spec or {}
    if request.text_format == "json_object":
        return OutputConstraint("json_object")
    if request.text_format == "json_schema":
        return OutputConstraint("json_schema", json.dumps(spec.get("schema") or {}))
    return None
