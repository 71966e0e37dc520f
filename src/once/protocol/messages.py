"""Anthropic Messages requests as plain data: validated with the `anthropic` SDK's types,
then mapped onto the pipeline's request (Responses items).

The body is checked strictly (no coercion) against `MessageCreateParams`, each message and
tool against its own type, so an error names the field at fault. Then:

- `system` (a string or text blocks) becomes the instructions; a later `system` message
  stays a system message where it is;
- a message's text blocks become its text; `image` blocks become `input_image` parts (the
  gateway's semantic check refuses them for a text-only model); `document` blocks are
  refused there as files;
- an assistant `tool_use` block becomes a `function_call` (`call_id` = its id, arguments
  its input as JSON); a user `tool_result` block becomes a `function_call_output` (its
  text; `is_error` prefixes "Error: "), in the order the blocks come;
- `thinking` and `redacted_thinking` blocks are dropped: the served models do not think in
  blocks, and a request's `thinking` setting is accepted and has no effect;
- custom tools become function tools (`input_schema` -> `parameters`); Anthropic's server
  tools (web search, code execution, ...) are left out of the prompt and listed in
  `ignored_tools`, which the front end reports in the `once-ignored-tools` header;
- `cache_control` anywhere is accepted: once caches every prefix anyway, and reports the
  engine's cache in `cache_read_input_tokens`.
"""

import functools
import json
from typing import Any

from once.protocol.errors import InvalidRequestError
from once.protocol.responses import (
    FUNCTION_CALL,
    FUNCTION_CALL_OUTPUT,
    MESSAGE,
    ResponsesRequest,
    function_tool,
)
from once.protocol.schema import SdkType, validate


@functools.cache
def _adapter(name: str):
    from anthropic.types import (
        assistant_message_param,
        message_create_params,
        system_message_param,
        tool_param,
        user_message_param,
    )

    types = {
        "body": message_create_params.MessageCreateParamsBase,
        "user": user_message_param.UserMessageParam,
        "assistant": assistant_message_param.AssistantMessageParam,
        "system": system_message_param.SystemMessageParam,
        "custom": tool_param.ToolParam,
    }
    return SdkType(types[name])


@functools.cache
def _block_types() -> dict[str, Any]:
    """A message's content block types by their `type` (the SDK's MessageContentParam)."""
    import typing

    from anthropic.types.message_content_param import MessageContentParam

    from once.protocol.schema import types_by_name

    blocks = typing.get_args(MessageContentParam)[1]  # Iterable[Union[...]]
    return types_by_name(typing.get_args(blocks)[0])


@functools.cache
def _block_adapter(kind: str) -> SdkType:
    return SdkType(_block_types()[kind])


def _check_blocks(content: Any, param: str) -> None:
    """Each block against its own type, picked by its `type`: checked as the members of
    one union, a block of an unknown type (or a text block without its text) was reported
    as missing the `tool_use_id` of the union's last candidate."""
    if not isinstance(content, list):
        return  # a string, or not content at all: the message's own check says so
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise InvalidRequestError("a content block must be an object", param=f"{param}[{j}]")
        kind = block.get("type")
        if kind is None:
            raise InvalidRequestError(
                f"missing required parameter: '{param}[{j}].type'", param=f"{param}[{j}].type"
            )
        if kind not in _block_types():
            raise InvalidRequestError(
                f"unknown content block type {kind!r}; expected one of "
                f"{', '.join(sorted(_block_types()))}",
                param=f"{param}[{j}].type",
            )
        validate(_block_adapter(kind), block, f"{param}[{j}]", strict=True)


def warm_up() -> None:
    for name in ("body", "user", "assistant", "system", "custom"):
        _adapter(name)


def parse_count_tokens_request(body: Any) -> ResponsesRequest:
    """`/v1/messages/count_tokens` takes a Messages body without `max_tokens`, and refuses
    `stream` (Anthropic's count_tokens has none; the OpenAPI document lists none)."""
    if isinstance(body, dict) and "stream" in body:
        raise InvalidRequestError("stream: extra inputs are not permitted", param="stream")
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    return parse_messages_request(body)


def parse_messages_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    for name in ("model", "messages", "max_tokens"):
        if name not in body:
            raise InvalidRequestError(f"missing required parameter: {name!r}", param=name)
    messages, tools = body["messages"], body.get("tools") or []
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    top = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    validate(_adapter("body"), {**top, "messages": []}, strict=True)
    if body["max_tokens"] < 1:
        raise InvalidRequestError("max_tokens must be >= 1", param="max_tokens")
    _check_sampling(body)
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise InvalidRequestError(
                f"unsupported message role {role!r}", param=f"messages[{i}].role"
            )
        _check_blocks(message.get("content"), f"messages[{i}].content")
        validate(_adapter(role), message, f"messages[{i}]", strict=True)
    function_tools, ignored = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequestError("each tool must be an object", param=f"tools[{i}]")
        if tool.get("type") in (None, "custom"):
            validate(_adapter("custom"), tool, f"tools[{i}]", strict=True)
            function_tools.append(_function_tool(tool))
        else:
            ignored.append(str(tool.get("name") or tool.get("type")))
    choice = body.get("tool_choice") or {"type": "auto"}
    stops = tuple(body.get("stop_sequences") or ())
    if any(not stop for stop in stops):
        raise InvalidRequestError("stop sequences must not be empty", param="stop_sequences")
    return ResponsesRequest(
        model=body["model"],
        input_items=_items(messages),
        instructions=_text(body.get("system")) or None,
        tools=tuple(function_tools),
        tool_choice=_tool_choice(choice),
        parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
        store=False,
        stream=bool(body.get("stream")),
        max_output_tokens=body["max_tokens"],
        max_output_tokens_param="max_tokens",
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=body.get("top_k"),
        # The Messages API has no prompt_cache_key: its user id names the session (Claude
        # Code sends its session's), which keeps a conversation on one replica.
        prompt_cache_key=(body.get("metadata") or {}).get("user_id"),
        metadata={k: str(v) for k, v in (body.get("metadata") or {}).items() if v is not None},
        stop=stops,
        ignored_tools=tuple(ignored),
        **_text_format((body.get("output_config") or {}).get("format")),
    )


def _text_format(output_format: dict | None) -> dict:
    """`output_config.format` (a JSON schema) as the Responses API's `text.format`."""
    if not output_format or output_format.get("type") != "json_schema":
        return {}
    return {"text_format": "json_schema", "text_format_spec": dict(output_format)}


def _check_sampling(body: dict) -> None:
    # The SDK's types no longer list Anthropic's sampling fields; the API still takes them.
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"{name} must be a number", param=name)
        if name == "top_p" and not low < value <= high:
            raise InvalidRequestError(f"top_p must be in (0, {high:g}]", param=name)
        if not low <= value <= high:
            raise InvalidRequestError(f"{name} must be in [{low:g}, {high:g}]", param=name)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise InvalidRequestError("top_k must be a non-negative integer", param="top_k")


def _items(messages: list[dict]) -> tuple[dict, ...]:
    items: list[dict] = []
    tool_use_ids: set[str] = set()  # of the tool_use blocks so far
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            items.append({"type": MESSAGE, "role": role, "content": content})
            continue
        parts: list[dict] = []  # text and images of the message, up to its next tool block
        for j, block in enumerate(content):
            kind = block.get("type")
            if kind == "text":
                parts.append({"type": "input_text", "text": block["text"]})
            elif kind == "image":
                parts.append({"type": "input_image", "image_url": _image_url(block)})
            elif kind in ("tool_use", "tool_result"):
                _check_tool_use_id(block, tool_use_ids, f"messages[{i}].content[{j}]")
                _flush(items, role, parts)
                items.append(_tool_item(block))
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:  # documents, search results, server tool blocks: files to this server
                parts.append({"type": "input_file"})
        _flush(items, role, parts)
    return tuple(items)


def _check_tool_use_id(block: dict, tool_use_ids: set[str], param: str) -> None:
    """Anthropic's rule: a tool_result answers a tool_use that came before it."""
    if block["type"] == "tool_use":
        tool_use_ids.add(block["id"])
    elif block["tool_use_id"] not in tool_use_ids:
        raise InvalidRequestError(
            f"unexpected `tool_use_id` found in `tool_result` blocks: {block['tool_use_id']}. "
            "Each `tool_result` block must have a corresponding `tool_use` block before it",
            param=f"{param}.tool_use_id",
        )


def _flush(items: list[dict], role: str, parts: list[dict]) -> None:
    if not parts:
        return
    if role == "assistant":
        text = "".join(part.get("text", "") for part in parts)
        items.append({"type": MESSAGE, "role": role, "content": text})
    else:
        items.append({"type": MESSAGE, "role": role, "content": list(parts)})
    parts.clear()


def _tool_item(block: dict) -> dict:
    if block["type"] == "tool_use":
        arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
        return {
            "type": FUNCTION_CALL,
            "call_id": block["id"],
            "name": block["name"],
            "arguments": arguments,
        }
    output = _text(block.get("content"))
    if block.get("is_error"):
        output = f"Error: {output}"
    return {"type": FUNCTION_CALL_OUTPUT, "call_id": block["tool_use_id"], "output": output}


def _image_url(block: dict) -> str | None:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    return source.get("url")


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.get("text", "") for block in content if block.get("type") == "text")


def _function_tool(tool: dict) -> dict:
    return function_tool(
        tool["name"], tool.get("description"), tool.get("input_schema"), tool.get("strict")
    )


def _tool_choice(choice: dict) -> Any:
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "name": choice.get("name")}
    return kind  # auto | none
