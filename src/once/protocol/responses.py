"""Responses API requests as plain data: schema validation with the SDK's own types.

A request body is checked against the official `openai` SDK's TypedDicts (through a pydantic
TypeAdapter, so the schema is exactly what the SDK sends), then normalized into one
`ResponsesRequest`: every input item gets its `type`, a string input becomes one user
message, and unknown fields are dropped. Whether the server *supports* a valid request (a
hosted tool, an image for a text-only model) is the gateway's semantic check, not this one.
"""

import functools
import json
from dataclasses import dataclass
from typing import Any

from once.protocol.errors import InvalidRequestError
from once.protocol.schema import SdkType, types_by_name, validate

# Item types the renderer reads; every other item type the SDK defines is accepted and
# left out of the prompt (the output of a hosted tool this server has no backend for).
MESSAGE = "message"
FUNCTION_CALL = "function_call"
FUNCTION_CALL_OUTPUT = "function_call_output"
CUSTOM_TOOL_CALL = "custom_tool_call"
CUSTOM_TOOL_CALL_OUTPUT = "custom_tool_call_output"
TOOL_SEARCH_CALL = "tool_search_call"
TOOL_SEARCH_OUTPUT = "tool_search_output"
ADDITIONAL_TOOLS = "additional_tools"  # tools made available from this point on
REASONING = "reasoning"  # accepted and skipped: this server's models do not reason in items
CALL_ITEM_TYPES = (FUNCTION_CALL, CUSTOM_TOOL_CALL, TOOL_SEARCH_CALL)


@dataclass(frozen=True)
class ResponsesRequest:
    """A request as the gateway's pipeline takes it, whichever API it came in by: the
    Responses API's fields, plus the sampling controls the other APIs add."""

    model: str
    input_items: tuple[dict, ...]
    instructions: str | None = None
    tools: tuple[dict, ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    # The API's own name for max_output_tokens, so that an error names what the client sent
    # (Chat: max_completion_tokens or max_tokens; Messages: max_tokens).
    max_output_tokens_param: str = "max_output_tokens"
    temperature: float | None = None
    top_p: float | None = None
    prompt_cache_key: str | None = None
    metadata: dict | None = None
    # WebSocket mode only: generate=False warms the cache (render, tokenize, prefill).
    generate: bool = True
    # Fields the server accepts but must refuse when set (checked semantically).
    background: bool = False
    text_format: str = "text"  # text | json_schema | json_object
    text_format_spec: dict | None = None  # the whole format object (schema, name, strict)
    # Chat Completions and Messages: stop strings, a sampling seed, top-k.
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int | None = None
    # Log probabilities of the output text: None off, else how many alternatives a token.
    logprobs: int | None = None
    # Tools the request named that this server leaves out of the prompt (hosted tools with
    # no backend here); the front end reports them.
    ignored_tools: tuple[str, ...] = ()
    # Declarations of the hosted tools this server runs through an operator's backend
    # (gateway/backend_tools.py; set at admission): they reach the prompt with `tools`.
    hosted_functions: tuple[dict, ...] = ()
    include: tuple[str, ...] = ()  # the request's `include`

    @property
    def prompt_tools(self) -> tuple[dict, ...]:
        return self.tools + self.hosted_functions


@functools.cache
def _adapter(name: str):
    """TypeAdapters over the SDK's own TypedDicts, built once (~0.5 s for the body's):
    the request bodies, and every input item and tool type by its `type`."""
    from openai.types.responses import (
        easy_input_message_param,
        response_create_params,
        response_input_item_param,
        responses_client_event_param,
        tool_param,
    )

    bodies = {
        "http": response_create_params.ResponseCreateParamsBase,
        "websocket": responses_client_event_param.ResponseCreate,
        MESSAGE: easy_input_message_param.EasyInputMessageParam,
    }
    if name in bodies:
        return SdkType(bodies[name])
    kind, _, type_name = name.partition(":")
    union = (
        tool_param.ToolParam if kind == "tool" else response_input_item_param.ResponseInputItemParam
    )
    member = types_by_name(union).get(type_name)
    return None if member is None else SdkType(member)


def warm_up() -> None:
    """Build the validators now instead of on the first request."""
    for name in ("http", "websocket", MESSAGE, f"item:{FUNCTION_CALL}", "tool:function"):
        _adapter(name)


def _validate(name: str, value: Any, prefix: str) -> None:
    validate(_adapter(name), value, prefix, strict=True)


def parse_request(body: Any, *, websocket: bool = False) -> ResponsesRequest:
    """Validate a decoded JSON body; raise InvalidRequestError naming the bad param.

    The top level is checked against the SDK's request type with `input` and `tools`
    held out; each item and tool is then checked against the SDK type its `type` names,
    so an error points at the one field that is wrong instead of at every union branch.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    if "model" not in body:
        raise InvalidRequestError("missing required parameter: 'model'", param="model")
    raw_input = body.get("input")
    if raw_input is None:
        raise InvalidRequestError("missing required parameter: 'input'", param="input")
    if not isinstance(raw_input, str | list):
        raise InvalidRequestError("'input' must be a string or a list of items", param="input")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    top = {k: v for k, v in body.items() if k not in ("input", "tools")}
    if websocket:
        top["type"] = "response.create"
    _validate("websocket" if websocket else "http", top, "")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise InvalidRequestError("'stream' must be a boolean", param="stream")
    items = normalize_input(raw_input)
    for i, item in enumerate(items):
        _validate_item(item, f"input[{i}]")
    for i, tool in enumerate(tools):
        validate_tool(tool, f"tools[{i}]")
    text = body.get("text") or {}
    return ResponsesRequest(
        model=str(body["model"]),
        input_items=items,
        instructions=body.get("instructions"),
        tools=tuple(tools),
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        previous_response_id=body.get("previous_response_id"),
        store=body.get("store") is not False,
        stream=bool(body.get("stream")),
        max_output_tokens=body.get("max_output_tokens"),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        prompt_cache_key=body.get("prompt_cache_key"),
        metadata=body.get("metadata"),
        generate=body.get("generate") is not False,
        background=bool(body.get("background")),
        text_format=((text.get("format") or {}).get("type") or "text"),
        text_format_spec=text.get("format"),
        logprobs=_logprobs(body),
        include=tuple(str(i) for i in body.get("include") or ()),
    )


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs(body: dict) -> int | None:
    """`include: ["message.output_text.logprobs"]` turns them on; `top_logprobs` adds
    alternatives."""
    if LOGPROBS_INCLUDE not in (body.get("include") or ()):
        return None
    return body.get("top_logprobs") or 0


def validate_tool(tool: Any, param: str) -> None:
    if not isinstance(tool, dict):
        raise InvalidRequestError("each tool must be an object", param=param)
    kind = tool.get("type")
    adapter = _adapter(f"tool:{kind}") if isinstance(kind, str) else None
    if adapter is None:
        raise InvalidRequestError(f"unknown tool type {kind!r}", param=f"{param}.type")
    if kind == "function":
        # The API defaults `parameters` and `strict`; the SDK's TypedDict marks them
        # required because it always sends them.
        tool = {"parameters": None, "strict": None, **tool}
    validate(adapter, tool, param, strict=True)


# Outputs that answer a call: without its call_id nothing ties them to it (the SDK's
# types mark call_id optional on some of them; the API requires it).
CALL_ANSWERS = (
    FUNCTION_CALL_OUTPUT,
    CUSTOM_TOOL_CALL_OUTPUT,
    "shell_call_output",
    "apply_patch_call_output",
)


def _validate_item(item: dict, param: str) -> None:
    kind = item["type"]
    if kind in CALL_ANSWERS and not isinstance(item.get("call_id"), str):
        raise InvalidRequestError(
            f"a {kind} item needs its call's 'call_id'", param=f"{param}.call_id"
        )
    adapter = _adapter(f"item:{kind}") if kind != MESSAGE else None
    if kind != MESSAGE and adapter is None:
        raise InvalidRequestError(f"unknown input item type {kind!r}", param=f"{param}.type")
    assistant_parts = item.get("role") == "assistant" and isinstance(item.get("content"), list)
    if kind == MESSAGE and assistant_parts:
        # A client that appends a response's output items sends output_text parts, which
        # the SDK types as an output message (with ids); accept any text parts.
        for j, part in enumerate(item["content"]):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    "assistant content parts need a string 'text'", param=f"{param}.content[{j}]"
                )
        return
    if isinstance(
        item.get("tools"), list
    ):  # a tool listing: its functions as the API defaults them
        item = {**item, "tools": [_with_function_defaults(tool) for tool in item["tools"]]}
    validate(adapter if adapter is not None else _adapter(MESSAGE), item, param, strict=True)


def _with_function_defaults(tool: Any) -> Any:
    # The API defaults a function's `parameters` and `strict`; the SDK's TypedDict marks them
    # required because it always sends them.
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"parameters": None, "strict": None, **tool}
    return tool


def normalize_input(raw_input: str | list) -> tuple[dict, ...]:
    if isinstance(raw_input, str):
        return ({"type": MESSAGE, "role": "user", "content": raw_input},)
    items = []
    for i, item in enumerate(raw_input):
        if not isinstance(item, dict):
            raise InvalidRequestError("each input item must be an object", param=f"input[{i}]")
        item = dict(item)
        item.setdefault("type", MESSAGE)
        items.append(item)
    return tuple(items)


def function_tool(name: str, description: str | None, parameters: dict | None, strict) -> dict:
    """A Responses function tool from another API's tool definition."""
    tool: dict[str, Any] = {"type": "function", "name": name}
    if description:
        tool["description"] = description
    tool["parameters"] = parameters or {"type": "object", "properties": {}}
    tool["strict"] = bool(strict)
    return tool


def message_text(item: dict) -> str:
    """The text of a message item: a string, or the text parts of a content list joined."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(
        part.get("text", "")
        for part in content or ()
        if part.get("type") in ("input_text", "output_text", "text")
    )


def output_text(item: dict) -> str:
    """The text of a function_call_output's `output` (a string or a list of parts)."""
    output = item.get("output")
    if isinstance(output, str):
        return output
    return "".join(part.get("text", "") for part in output or () if isinstance(part, dict))


def canonical_json(value: Any) -> str:
    """One serialization for everything that must be byte-stable (tools, fingerprints)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
