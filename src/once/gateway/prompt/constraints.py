"""What the engine must constrain a response's output to, from the request.

Three things constrain an output, enforced by the engine's grammar matcher (llguidance,
engine/grammar.py), and carried to it as `SamplingParams.constraint`:

- a `tool_choice` that forces a call (`required`, a named function or custom tool, or
  `allowed_tools` in `required` mode): the output is one `<tool_call>` block, written as
  the prompt asks (toolcalls.py), naming one of the tools it may call;
- a JSON text format (`text.format` `json_schema` or `json_object`; Chat Completions'
  `response_format`; Messages' `output_config.format`): the output is that JSON;
- otherwise, tools whose calls have a shape to keep (a strict function, a custom tool with
  a grammar `format`): text is free, but where the model opens a `<tool_call>` block it
  must write a call of a tool it may call (at most one without `parallel_tool_calls`).

In a call, a strict function's arguments follow its parameters schema and any other
function's are a JSON object; a custom tool's raw input follows its Lark or regex grammar
(an llguidance sub-grammar, `@input_<n>`, so its rules and lexer stay its own), or is any
text without one. A forced call wins over a text format, and a text format over calls in
auto mode. Forced outputs of a replay bypass any constraint in the engine.
"""

import functools
import json
from collections.abc import Sequence

import llguidance

from once.gateway.hosted.backend_tools import HOSTED_FUNCTION
from once.gateway.hosted.program_tool import PROGRAM_TOOL_NAME, PROGRAM_TOOL_TYPE, allows
from once.gateway.prompt.tool_items import NAMESPACE_SEPARATOR, is_tool_search
from once.gateway.prompt.toolcalls import CLOSE_TAG, OPEN_TAG
from once.protocol.engine import OutputConstraint
from once.protocol.errors import InvalidRequestError
from once.protocol.responses import ADDITIONAL_TOOLS, ResponsesRequest

ANY_OBJECT = {"type": "object"}


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
        elif kind in ("function", "custom", HOSTED_FUNCTION):
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


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark literal takes JSON's escapes


OPEN_LINE = _lark_string(OPEN_TAG + "\n")
CLOSE_LINE = _lark_string("\n" + CLOSE_TAG)
NEWLINE = _lark_string("\n")
_CLOSE_PATTERN = CLOSE_TAG.replace("/", "\\/")
# Outside a block, text is free; where the model opens one, it must write a call. The head
# is lazy so it ends at the first open tag; the tail may hold none (or it would escape).
AUTO_RULES = [
    f"call_head[lazy]: TEXT {_lark_string(OPEN_TAG)}",
    f"call_block: {NEWLINE} call",
    "TEXT: /(?s:.*)/",
    f"TAIL: /(?s:.*)/ & ~/(?s:.*){OPEN_TAG}(?s:.*)/",
]
# A custom tool's input without a grammar: any text, up to the first close of the block
# (lazy: the shortest match), which it includes.
FREE_INPUT_RULE = f"free_input[lazy]: /(?s:.+)\\n{_CLOSE_PATTERN}/"


def _input_grammar(name: str, format_: dict) -> dict:
    """A custom tool's `format` grammar as a named llguidance sub-grammar."""
    definition = str(format_.get("definition") or "")
    if format_.get("syntax") == "regex":
        # The pattern must match the whole input: anchors are implied, as in llguidance.
        pattern = definition.removeprefix("^")
        if pattern.endswith("$") and not pattern.endswith("\\$"):
            pattern = pattern[:-1]
        definition = "start: /" + pattern.replace("/", "\\/") + "/"
    return {"name": name, "lark_grammar": definition}


def check_tool_grammars(tools: Sequence[dict]) -> None:
    """A custom tool's grammar that llguidance cannot compile is a 400 naming it."""
    for i, tool in enumerate(tools):
        nested = tool.get("tools") if tool.get("type") == "namespace" else None
        for j, inner in enumerate(nested or (tool,)):
            format_ = inner.get("format") if inner.get("type") == "custom" else None
            if not format_ or format_.get("type") != "grammar":
                continue
            error = _grammar_error(str(format_.get("syntax")), str(format_.get("definition")))
            if error:
                where = f"tools[{i}].tools[{j}]" if nested is not None else f"tools[{i}]"
                raise InvalidRequestError(
                    f"the custom tool {inner.get('name')!r} has a grammar that does not "
                    f"compile: {error.strip()}",
                    param=f"{where}.format.definition",
                )


@functools.lru_cache(maxsize=256)
def _grammar_error(syntax: str, definition: str) -> str:
    grammar = _input_grammar("input", {"syntax": syntax, "definition": definition})
    return llguidance.LLMatcher.validate_grammar(json.dumps({"grammars": [grammar]}))


def _call_rules(tools: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """One Lark alternative per callable tool, as the prompt asks it written (toolcalls.py),
    and the sub-grammars of custom tools' formats."""
    rules: list[str] = []
    grammars: list[dict] = []
    for index, (name, tool) in enumerate(tools.items()):
        rule = f"call_{index}"
        if tool.get("type") == "custom":
            format_ = tool.get("format") or {}
            head = _lark_string(json.dumps({"name": name}) + "\n")
            if format_.get("type") == "grammar":
                grammars.append(_input_grammar(f"input_{index}", format_))
                rules.append(f"{rule}: {head} @input_{index} {CLOSE_LINE}")
            else:
                rules.append(f"{rule}: {head} free_input")
            continue
        schema = tool.get("parameters") if tool.get("strict") else None
        head = _lark_string(json.dumps({"name": name})[:-1] + ', "arguments": ')
        rules.append(f'{rule}: {head} arguments_{index} "}}" {CLOSE_LINE}')
        rules.append(f"arguments_{index}: %json {json.dumps(schema or ANY_OBJECT)}")
    rules.insert(0, "call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    return rules, grammars


def call_constraint(
    tools: dict[str, dict], forced: bool, parallel: bool = True
) -> OutputConstraint:
    """The grammar of calls of these tools: exactly one call when `forced`, otherwise any
    text with calls where the model opens a `<tool_call>` block (at most one unless
    `parallel`)."""
    rules, grammars = _call_rules(tools)
    if forced:
        top = [f"start: {OPEN_LINE} call"]
    else:
        top = [f"start: (call_head call_block){'*' if parallel else '?'} TAIL", *AUTO_RULES]
    lark = "\n".join([*top, FREE_INPUT_RULE, *rules]) + "\n"
    return OutputConstraint(
        "llguidance", json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})
    )


def enforces_calls(tool: dict) -> bool:
    """A tool whose calls the engine constrains even when none is forced: a strict function,
    a custom tool with a grammar."""
    if tool.get("type") == "custom":
        return (tool.get("format") or {}).get("type") == "grammar"
    return bool(tool.get("strict")) and isinstance(tool.get("parameters"), dict)


def output_constraint(request: ResponsesRequest, items: Sequence[dict]) -> OutputConstraint | None:
    callable_ = callable_tools(request.prompt_tools, items)
    names = forced_names(request.tool_choice, callable_)
    if names:
        return call_constraint({name: callable_[name] for name in names}, forced=True)
    spec = request.text_format_spec or {}
    if request.text_format == "json_object":
        return OutputConstraint("json_object")
    if request.text_format == "json_schema":
        return OutputConstraint("json_schema", json.dumps(spec.get("schema") or {}))
    allowed = _allowed_in_auto_mode(request.tool_choice, callable_)
    if allowed and any(enforces_calls(tool) for tool in allowed.values()):
        return call_constraint(allowed, forced=False, parallel=request.parallel_tool_calls)
    return None


def _allowed_in_auto_mode(choice: object, callable_: dict[str, dict]) -> dict[str, dict]:
    if choice == "none":
        return {}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        names = {str(t.get("name")) for t in choice.get("tools") or ()}
        return {name: tool for name, tool in callable_.items() if name in names}
    return callable_
