"""The schemas of the gateway's OpenAPI document, generated from the SDKs' own types.

Every request and response body the gateway documents is the JSON Schema pydantic
generates from the `openai` or `anthropic` SDK type the gateway validates with (or the SDK
parses the answer into), all in one pass so that definitions shared between bodies are
written once and names that collide across the SDKs (`ToolParam`) are told apart. On top,
only what the SDK types cannot say, each line with its reason:

- the request bodies' `stream` flag (the SDKs split each body into a streaming and a
  non-streaming type that differ in it alone; one body with the flag is what is served);
- the Responses body's `model` and `input`, which this server requires (the SDK's type
  makes them optional because the API can take them from a stored prompt);
- `/v1/messages/count_tokens` takes the Messages body without `max_tokens` (the route
  validates with the Messages type and fills in `max_tokens`) and without `stream`
  (refused, as Anthropic's count_tokens has none);
- the bounds the server enforces and the SDK types leave out: a non-empty `messages`
  (Chat, Messages), `top_p` in (0, 1] and `temperature` in [0, 2] (Responses, Chat);
- an input-item page's `first_id` / `last_id` are null on an empty page (the SDK types
  them as strings, which no empty page can honestly fill);
- the error bodies: OpenAI's `{"error": {...}}` with the `code` and `param` this server
  always sends, and Anthropic's `{"type": "error", "error": {...}}`, whose error types
  add `request_too_large` (the 413 of Anthropic's error documentation, missing from the
  SDK's union);
- the event-stream items: an SSE event as the OpenAPI 3.2 model writes it, `data` a JSON
  text (contentMediaType) holding the SDK's event type.
"""

import functools
from typing import Any

REF_TEMPLATE = "#/components/schemas/{model}"


def ref(name: str) -> dict:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _sdk_types() -> dict[str, Any]:
    from anthropic.types import (
        Message,
        MessageTokensCount,
        RawMessageStreamEvent,
        message_create_params,
    )
    from anthropic.types.shared import ErrorResponse as AnthropicErrorResponse
    from openai.types import Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, completion_create_params
    from openai.types.responses import (
        InputTokenCountResponse,
        Response,
        ResponseItemList,
        ResponseStreamEvent,
        response_create_params,
    )
    from openai.types.shared import ErrorObject

    return {
        "ResponseCreateRequest": response_create_params.ResponseCreateParamsBase,
        "Response": Response,
        "ResponseStreamEvent": ResponseStreamEvent,
        "ResponseItemList": ResponseItemList,
        "InputTokenCount": InputTokenCountResponse,
        "ChatCompletionCreateRequest": completion_create_params.CompletionCreateParamsBase,
        "ChatCompletion": ChatCompletion,
        "ChatCompletionChunk": ChatCompletionChunk,
        "MessageCreateRequest": message_create_params.MessageCreateParamsBase,
        "Message": Message,
        "MessageStreamEvent": RawMessageStreamEvent,
        "MessageTokensCount": MessageTokensCount,
        "Model": Model,
        "OpenAIErrorObject": ErrorObject,
        "AnthropicErrorResponse": AnthropicErrorResponse,
    }


@functools.cache
def component_schemas() -> dict[str, dict]:
    """Every schema of the document by component name: the bodies (the names above) and
    the definitions they reference. Built once per process (~0.5 s)."""
    from pydantic import TypeAdapter

    types = _sdk_types()
    inputs = [(name, "validation", TypeAdapter(sdk_type)) for name, sdk_type in types.items()]
    by_key, definitions = TypeAdapter.json_schemas(inputs, ref_template=REF_TEMPLATE)  # type: ignore[arg-type]
    schemas: dict[str, dict] = dict(definitions.get("$defs", {}))
    for (name, _), schema in by_key.items():
        # A body that is itself a definition comes back as a bare reference to it.
        if schema == ref(name):
            continue
        if name in schemas:
            raise RuntimeError(f"the component name {name!r} is an SDK definition's too")
        schemas[name] = schema
    _adjust(schemas)
    return schemas


def _deref(schemas: dict[str, dict], name: str) -> dict:
    # Follow a component that only points at another (a body named like its definition).
    schema = schemas[name]
    while set(schema) == {"$ref"}:
        schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _adjust(schemas: dict[str, dict]) -> None:
    stream_flag = {"type": "boolean", "description": "Answer as server-sent events."}
    for name in ("ResponseCreateRequest", "ChatCompletionCreateRequest", "MessageCreateRequest"):
        body = _deref(schemas, name)
        body["properties"]["stream"] = {"anyOf": [stream_flag, {"type": "null"}]}
    responses = _deref(schemas, "ResponseCreateRequest")
    responses["required"] = sorted({*responses.get("required", ()), "model", "input"})
    _bounds(schemas)
    messages = _deref(schemas, "MessageCreateRequest")
    schemas["MessageCountTokensRequest"] = {
        **messages,
        "title": "MessageCountTokensRequest",
        "required": [key for key in messages["required"] if key != "max_tokens"],
        "properties": {k: v for k, v in messages["properties"].items() if k != "stream"},
    }
    page = _deref(schemas, "ResponseItemList")
    for key in ("first_id", "last_id"):
        page["properties"][key] = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    schemas.update(_error_bodies(schemas))
    schemas.update(_stream_events())
    schemas.update(_small_bodies())


def _bounds(schemas: dict[str, dict]) -> None:
    # What validation.py and protocol/{chat,messages}.py refuse, said where a client reads.
    for name in ("ChatCompletionCreateRequest", "MessageCreateRequest"):
        body = _deref(schemas, name)
        body["properties"]["messages"] = {**body["properties"]["messages"], "minItems": 1}
    for name in ("ResponseCreateRequest", "ChatCompletionCreateRequest"):
        properties = _deref(schemas, name)["properties"]
        for key, bounds in (
            ("top_p", {"exclusiveMinimum": 0, "maximum": 1}),
            ("temperature", {"minimum": 0, "maximum": 2}),
        ):
            number = {"type": "number", **bounds}
            properties[key] = {**properties[key], "anyOf": [number, {"type": "null"}]}


def _error_bodies(schemas: dict[str, dict]) -> dict[str, dict]:
    anthropic = _deref(schemas, "AnthropicErrorResponse")
    request_too_large = {
        "type": "object",
        "title": "RequestTooLargeErrorObject",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"const": "request_too_large"}},
    }
    anthropic_error = {
        **anthropic,
        "properties": {
            **anthropic["properties"],
            "error": {"anyOf": [anthropic["properties"]["error"], request_too_large]},
        },
    }
    openai_error = {
        "type": "object",
        "title": "OpenAIError",
        "required": ["error"],
        "properties": {
            "error": {
                "allOf": [
                    ref("OpenAIErrorObject"),
                    {"required": ["code", "param"], "properties": {"code": {"type": "string"}}},
                ]
            }
        },
    }
    return {"AnthropicError": anthropic_error, "OpenAIError": openai_error}


def sse_event(data: dict, event: dict | None = None) -> dict:
    """One server-sent event: `data` is JSON text holding a `data` value, `event` its name."""
    properties: dict[str, Any] = {
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    }
    if event is not None:
        properties["event"] = event
    return {"type": "object", "required": ["data"], "properties": properties}


def _stream_events() -> dict[str, dict]:
    named_event = {"type": "string", "pattern": "^[a-z_.]+$"}
    # Anthropic's stream also carries `ping` and, for a failure mid-stream, an error body.
    anthropic_data = {
        "anyOf": [
            ref("MessageStreamEvent"),
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "ping"}}},
            ref("AnthropicError"),
        ]
    }
    # Chat Completions' stream has no event names: chunks, an error body, then `[DONE]`.
    done = {"type": "object", "required": ["data"], "properties": {"data": {"const": "[DONE]"}}}
    chat_data = {"anyOf": [ref("ChatCompletionChunk"), ref("OpenAIError")]}
    return {
        "ResponseServerSentEvent": sse_event(ref("ResponseStreamEvent"), named_event),
        "MessageServerSentEvent": sse_event(anthropic_data, named_event),
        "ChatCompletionServerSentEvent": {"anyOf": [done, sse_event(chat_data)]},
    }


def _small_bodies() -> dict[str, dict]:
    # Bodies no SDK types (the SDK's delete returns nothing; /v1/models adds `aliases`).
    return {
        "ResponseDeleted": {
            "type": "object",
            "required": ["id", "object", "deleted"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "response.deleted"},
                "deleted": {"const": True},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": {
                        "allOf": [
                            ref("Model"),
                            {
                                "required": ["aliases"],
                                "properties": {
                                    "aliases": {"type": "array", "items": {"type": "string"}}
                                },
                            },
                        ]
                    },
                },
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"const": "ok"}},
        },
    }
