"""Chat Completions requests as plain data: validated with the SDK's types, then mapped
onto the pipeline's request (Responses items), the way LiteLLM bridges the two APIs.

The body is checked strictly (no coercion: a string is not a number) against the `openai`
SDK's `CompletionCreateParams`, each message against the type its `role` names. Then:

- leading system and developer messages become the instructions (the renderer puts the
  tool list in the same system turn, as for a Responses request); a later one stays a
  system message where it is;
- user content parts become input parts (`image_url` -> `input_image`, whose checks are
  the gateway's semantic ones; `file` -> `input_file`, refused there);
- an assistant message becomes its text message plus one `function_call` item per tool
  call (`call_id` = the call's `id`); a `tool` message becomes a `function_call_output`;
- `tools` become Responses function tools; a named `tool_choice` becomes
  `{"type": "function", "name": ...}`.

What the engine cannot do is refused with a 400 naming the param (`n` above 1,
penalties, logit bias, audio); `response_format` becomes the Responses `text.format`;
what changes nothing here is accepted and ignored (`user`, `store`, `service_tier`,
`reasoning_effort`, `verbosity`, `safety_identifier`, `metadata` is kept).
"""

import functools
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

MAX_STOP_SEQUENCES = 4  # as OpenAI's API
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_REFUSED_WHEN_SET = ("audio", "prediction", "function_call", "functions", "logit_bias")
_ZERO_OR_UNSET = ("frequency_penalty", "presence_penalty")


@functools.cache
def _adapter(name: str):
    from openai.types.chat import (
        chat_completion_assistant_message_param,
        chat_completion_developer_message_param,
        chat_completion_function_tool_param,
        chat_completion_system_message_param,
        chat_completion_tool_message_param,
        chat_completion_user_message_param,
        completion_create_params,
    )

    types = {
        "body": completion_create_params.CompletionCreateParamsBase,
        "system": chat_completion_system_message_param.ChatCompletionSystemMessageParam,
        "developer": chat_completion_developer_message_param.ChatCompletionDeveloperMessageParam,
        "user": chat_completion_user_message_param.ChatCompletionUserMessageParam,
        "assistant": chat_completion_assistant_message_param.ChatCompletionAssistantMessageParam,
        "tool": chat_completion_tool_message_param.ChatCompletionToolMessageParam,
        "function": chat_completion_function_tool_param.ChatCompletionFunctionToolParam,
    }
    return SdkType(types[name])


def warm_up() -> None:
    for name in ("body", "system", "developer", "user", "assistant", "tool", "function"):
        _adapter(name)


def parse_chat_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    for name in ("model", "messages"):
        if name not in body:
            raise InvalidRequestError(f"missing required parameter: {name!r}", param=name)
    messages, tools = body["messages"], body.get("tools") or []
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in RESPONSE_FORMATS:
        raise InvalidRequestError(
            f"response_format type {response_format.get('type')!r} is not one of "
            f"{', '.join(RESPONSE_FORMATS)}",
            param="response_format.type",
        )
    top = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    validate(_adapter("body"), {**top, "messages": []}, strict=True)
    _refuse_unsupported(body)
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidRequestError(
                f"unsupported message role {role!r}", param=f"messages[{i}].role"
            )
        validate(_adapter(role), message, f"messages[{i}]", strict=True)
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(
                f"tool type {kind!r} is not supported here; only function tools are",
                param=f"tools[{i}].type",
            )
        validate(_adapter("function"), tool, f"tools[{i}]", strict=True)
    instructions, items = _items(messages)
    if (body.get("response_format") or {}).get("type") == "json_object" and not any(
        "json" in _text(m.get("content")).lower() for m in messages
    ):
        raise InvalidRequestError(
            "'messages' must contain the word 'json' to use response_format 'json_object'",
            param="messages",
        )
    max_tokens_param = "max_completion_tokens"
    max_tokens = body.get(max_tokens_param)
    if max_tokens is None:
        max_tokens_param = "max_tokens"
        max_tokens = body.get(max_tokens_param)
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise InvalidRequestError(
            f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop"
        )
    return ResponsesRequest(
        model=body["model"],
        input_items=items,
        instructions=instructions,
        tools=tuple(_function_tool(tool["function"]) for tool in tools),
        tool_choice=_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        store=False,
        stream=bool(body.get("stream")),
        max_output_tokens=max_tokens,
        max_output_tokens_param=max_tokens_param,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        prompt_cache_key=body.get("prompt_cache_key"),
        metadata=body.get("metadata"),
        stop=stops,
        seed=body.get("seed"),
        logprobs=(body.get("top_logprobs") or 0) if body.get("logprobs") else None,
        **_text_format(body.get("response_format")),
    )


def _text_format(response_format: dict | None) -> dict:
    """Chat's `response_format` as the Responses API's `text.format`."""
    kind = (response_format or {}).get("type", "text")
    if kind != "json_schema":
        return {"text_format": kind}
    spec = (response_format or {}).get("json_schema") or {}
    return {"text_format": kind, "text_format_spec": {"type": kind, **spec}}


def include_usage(body: object) -> bool:
    options = body.get("stream_options") if isinstance(body, dict) else None
    return bool((options or {}).get("include_usage"))


def _refuse_unsupported(body: dict) -> None:
    if (body.get("n") or 1) != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")
    if body.get("top_logprobs") and not body.get("logprobs"):
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    for name in _REFUSED_WHEN_SET:
        if body.get(name):
            raise InvalidRequestError(f"{name!r} is not supported by this server", param=name)
    for name in _ZERO_OR_UNSET:
        if body.get(name):
            raise InvalidRequestError(f"{name!r} must be 0 or unset here", param=name)
    if "audio" in (body.get("modalities") or ()):
        raise InvalidRequestError("only text output is supported", param="modalities")


def _items(messages: list[dict]) -> tuple[str | None, tuple[dict, ...]]:
    leading: list[str] = []
    items: list[dict] = []
    call_ids: set[str] = set()  # of the assistant's tool calls so far
    for i, message in enumerate(messages):
        role = message["role"]
        if role in ("system", "developer") and not items:
            leading.append(_text(message.get("content")))
        elif role in ("system", "developer", "user"):
            content = message.get("content")
            parts = content if isinstance(content, str) else [_part(p) for p in content or ()]
            items.append({"type": MESSAGE, "role": role, "content": parts})
        elif role == "assistant":
            text = _text(message.get("content"))
            if text:
                items.append({"type": MESSAGE, "role": "assistant", "content": text})
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                call_ids.add(call.get("id", ""))
                items.append(
                    {
                        "type": FUNCTION_CALL,
                        "call_id": call.get("id", ""),
                        "name": function.get("name", ""),
                        "arguments": function.get("arguments", ""),
                    }
                )
        else:  # tool
            output = _text(message.get("content"))
            call_id = message["tool_call_id"]
            if call_id not in call_ids:  # OpenAI's rule: a tool message answers a call
                raise InvalidRequestError(
                    f"messages[{i}] has role 'tool' but answers no preceding tool call "
                    f"(no assistant tool_calls entry has id {call_id!r})",
                    param=f"messages[{i}].tool_call_id",
                )
            items.append({"type": FUNCTION_CALL_OUTPUT, "call_id": call_id, "output": output})
    instructions = "\n\n".join(leading) if leading else None
    return instructions, tuple(items)


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _part(part: dict) -> dict:
    kind = part.get("type")
    if kind == "text":
        return {"type": "input_text", "text": part["text"]}
    if kind == "image_url":
        return {"type": "input_image", "image_url": (part.get("image_url") or {}).get("url")}
    return {"type": "input_file"}  # files and audio: refused by the semantic check


def _function_tool(function: dict) -> dict:
    return function_tool(
        function["name"], function.get("description"), function.get("parameters"),
        function.get("strict"),
    )  # fmt: skip


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "name": (choice.get("function") or {}).get("name")}
    return choice
