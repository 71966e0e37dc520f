"""The gateway's OpenAPI 3.1 document, served at `/openapi.json`.

The routes read and validate their bodies themselves (bounded, then the SDKs' types in
protocol/), so FastAPI sees no body parameters and would document none; this module
describes each HTTP route from a table instead: its request body, its 200 bodies (JSON,
and `text/event-stream` where it streams) and every error status it really returns, with
the error body of its API (OpenAI's, or Anthropic's under /v1/messages) and the headers
that go with it (`Allow` on a 405, `retry-after` on a 429). The schemas come from the SDK
types (openapi_types.py). The document is built once, when the app is, and served as the
same bytes every time.

WebSocket mode (`/v1/responses`) has no place in OpenAPI; the document's description
points at it. Security schemes are declared only when the gateway checks API keys.
"""

import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.routing import compile_path

from once.gateway.admission.capacity import LOAD_REPORT_HEADER
from once.gateway.apis.responses.input_items import MAX_LIMIT
from once.gateway.front.http_io import IGNORED_TOOLS_HEADER
from once.gateway.front.openapi_types import component_schemas, ref

OPENAPI_VERSION = "3.1.0"
JSON = "application/json"
EVENT_STREAM = "text/event-stream"
STATUS_DESCRIPTIONS = {
    200: "OK",
    400: "Invalid request: not JSON, or a field the schema or the server refuses (`param`)",
    401: "A missing or unknown API key",
    404: "An unknown model or response id, or no such path",
    405: "The path does not take this method; `Allow` lists the ones it takes",
    409: "A conflicting request is in progress",
    413: "The body is over the server's size limit",
    429: "A rate limit was reached; retry after `retry-after` seconds",
    500: "The response failed in the engine",
    503: "The engine is overloaded or unavailable",
}
# What each kind of operation can answer, besides 200.
GENERATE_ERRORS = (400, 401, 404, 405, 413, 429, 500, 503)
COUNT_ERRORS = (400, 401, 404, 405, 413, 429, 503)
STORED_ERRORS = (401, 404, 405)
PLAIN_ERRORS = (405,)

DESCRIPTION = (
    "once's gateway: the OpenAI Responses API (HTTP, SSE and WebSocket mode on "
    "`/v1/responses`, whose `response.create` frames take this POST body plus `type`), "
    "Chat Completions and the Anthropic Messages API on one pipeline."
)


@dataclass(frozen=True)
class Operation:
    summary: str
    ok: dict[str, dict]  # media type -> schema of the 200 body
    errors: tuple[int, ...]
    body: str | None = None  # the request body's component
    anthropic: bool = False  # Anthropic's error body instead of OpenAI's
    parameters: tuple[dict, ...] = ()
    authenticated: bool = True
    ok_headers: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()


def _json(name: str) -> dict[str, dict]:
    return {JSON: {"schema": ref(name)}}


def _json_or_stream(name: str, event: str) -> dict[str, dict]:
    return {JSON: {"schema": ref(name)}, EVENT_STREAM: {"schema": ref(event)}}


RESPONSE_ID = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "minLength": 1},
}
INPUT_ITEMS_QUERY = (
    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
    {
        "name": "limit",
        "in": "query",
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": 20},
    },
    {"name": "after", "in": "query", "schema": {"type": "string"}},
)
GENERATED_HEADERS = (LOAD_REPORT_HEADER, IGNORED_TOOLS_HEADER)
GREETING = "Say hello."


def example_body(component: str, model: str) -> dict:
    """The smallest request each body takes, for the served `model`."""
    messages = [{"role": "user", "content": GREETING}]
    if component == "ResponseCreateRequest":
        return {"model": model, "input": GREETING}
    if component == "MessageCreateRequest":
        return {"model": model, "max_tokens": 16, "messages": messages}
    return {"model": model, "messages": messages}


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/responses"): Operation(
        "Create a response",
        _json_or_stream("Response", "ResponseServerSentEvent"),
        GENERATE_ERRORS,
        body="ResponseCreateRequest",
        ok_headers=GENERATED_HEADERS,
        tags=("responses",),
    ),
    ("POST", "/v1/responses/input_tokens"): Operation(
        "Count a response request's input tokens",
        _json("InputTokenCount"),
        COUNT_ERRORS,
        body="ResponseCreateRequest",
        tags=("responses",),
    ),
    ("GET", "/v1/responses/{response_id}"): Operation(
        "Get a stored response",
        _json("Response"),
        STORED_ERRORS,
        parameters=(RESPONSE_ID,),
        tags=("responses",),
    ),
    ("GET", "/v1/responses/{response_id}/input_items"): Operation(
        "List a stored response's input items",
        _json("ResponseItemList"),
        (400, *STORED_ERRORS),
        parameters=(RESPONSE_ID, *INPUT_ITEMS_QUERY),
        tags=("responses",),
    ),
    ("DELETE", "/v1/responses/{response_id}"): Operation(
        "Delete a stored response",
        _json("ResponseDeleted"),
        STORED_ERRORS,
        parameters=(RESPONSE_ID,),
        tags=("responses",),
    ),
    ("POST", "/v1/chat/completions"): Operation(
        "Create a chat completion",
        _json_or_stream("ChatCompletion", "ChatCompletionServerSentEvent"),
        GENERATE_ERRORS,
        body="ChatCompletionCreateRequest",
        ok_headers=GENERATED_HEADERS,
        tags=("chat",),
    ),
    ("POST", "/v1/messages"): Operation(
        "Create a message (Anthropic)",
        _json_or_stream("Message", "MessageServerSentEvent"),
        GENERATE_ERRORS,
        body="MessageCreateRequest",
        anthropic=True,
        ok_headers=GENERATED_HEADERS,
        tags=("messages",),
    ),
    ("POST", "/v1/messages/count_tokens"): Operation(
        "Count a message request's input tokens (Anthropic)",
        _json("MessageTokensCount"),
        COUNT_ERRORS,
        body="MessageCountTokensRequest",
        anthropic=True,
        tags=("messages",),
    ),
    ("GET", "/v1/models"): Operation(
        "List the served models", _json("ModelList"), PLAIN_ERRORS, authenticated=False
    ),
    ("GET", "/healthz"): Operation("Liveness", _json("Health"), PLAIN_ERRORS, authenticated=False),
    ("GET", "/metrics"): Operation(
        "Prometheus metrics",
        {"text/plain": {"schema": {"type": "string"}}},
        PLAIN_ERRORS,
        authenticated=False,
    ),
}

HEADERS = {
    "allow": {"description": "The methods the path takes", "schema": {"type": "string"}},
    "retry-after": {
        "description": "Seconds to wait before retrying",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    LOAD_REPORT_HEADER: {
        "description": "The server's load (ORCA's format), for load balancers",
        "schema": {"type": "string"},
    },
    IGNORED_TOOLS_HEADER: {
        "description": "The request's hosted tools this server left out of the prompt",
        "schema": {"type": "string"},
    },
}
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def _header_refs(names) -> dict[str, dict]:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in names}


def _error_response(status: int, anthropic: bool) -> dict:
    schema = ref("AnthropicError" if anthropic else "OpenAIError")
    response: dict = {
        "description": STATUS_DESCRIPTIONS[status],
        "content": {JSON: {"schema": schema}},
    }
    if status == 405:
        response["headers"] = _header_refs(["allow"])
    elif status == 429:
        response["headers"] = _header_refs(["retry-after"])
    return response


def operation_object(operation: Operation, auth: bool, model: str | None = None) -> dict:
    ok = {name: dict(media) for name, media in operation.ok.items()}
    responses: dict[str, dict] = {"200": {"description": "OK", "content": ok}}
    if operation.ok_headers:
        responses["200"]["headers"] = _header_refs(operation.ok_headers)
    for status in operation.errors:
        if status == 401 and not auth:
            continue  # an open gateway never asks for a key
        responses[str(status)] = _error_response(status, operation.anthropic)
    result: dict = {"summary": operation.summary, "responses": responses}
    if operation.tags:
        result["tags"] = list(operation.tags)
    if operation.parameters:
        result["parameters"] = [dict(parameter) for parameter in operation.parameters]
    if operation.body is not None:
        media: dict = {"schema": ref(operation.body)}
        if model is not None:
            media["example"] = example_body(operation.body, model)
        result["requestBody"] = {"required": True, "content": {JSON: media}}
    if auth and operation.authenticated:
        schemes: list[dict] = (
            [{"bearer": []}, {"x-api-key": []}] if operation.anthropic else [{"bearer": []}]
        )
        result["security"] = schemes
    return result


def documented_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route the app puts in its schema, as FastAPI finds
    them (through included routers too)."""
    paths = get_openapi(title=app.title, version=app.version, routes=app.routes)["paths"]
    return sorted((method.upper(), path) for path, item in paths.items() for method in item)


class PathMethods:
    """The methods each documented path takes, for a 405's `Allow` header. A path matching
    several routes takes the methods of them all, except that a concrete path (no
    parameters) wins over a template that also matches, as OpenAPI reads paths."""

    def __init__(self, routes: list[tuple[str, str]]):
        by_path: dict[str, set[str]] = {}
        for method, path in routes:
            by_path.setdefault(path, set()).add(method)
        self._paths = [
            (compile_path(path)[0], "{" not in path, methods) for path, methods in by_path.items()
        ]

    def allowed(self, path: str) -> list[str]:
        matches = [
            (concrete, methods) for regex, concrete, methods in self._paths if regex.match(path)
        ]
        chosen = [methods for concrete, methods in matches if concrete] or [m for _, m in matches]
        return sorted(set().union(*chosen))


def openapi_document(app: FastAPI, *, auth: bool, models: list[str]) -> dict:
    """The document for `app`'s routes; `auth`: the gateway checks API keys; `models`: the
    served models (the request examples name the first)."""
    paths: dict[str, dict] = {}
    for method, path in documented_routes(app):
        operation = OPERATIONS.get((method, path))
        if operation is None:
            # A route added without a row here: documented as answering, no more.
            operation = Operation(path, {JSON: {"schema": {}}}, PLAIN_ERRORS)
        model = models[0] if models else None
        paths.setdefault(path, {})[method.lower()] = operation_object(operation, auth, model)
    components: dict = {"schemas": component_schemas(), "headers": HEADERS}
    if auth:
        components["securitySchemes"] = SECURITY_SCHEMES
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": app.title, "version": app.version, "description": DESCRIPTION},
        "paths": paths,
        "components": components,
    }


def encoded_document(app: FastAPI, *, auth: bool, models: list[str]) -> bytes:
    document = openapi_document(app, auth=auth, models=models)
    return json.dumps(document, separators=(",", ":")).encode()
