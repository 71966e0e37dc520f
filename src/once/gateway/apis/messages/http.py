"""The Anthropic Messages API over HTTP: `POST /v1/messages` (JSON or SSE) and
`POST /v1/messages/count_tokens`, on the same pipeline as the OpenAI APIs.

Authentication takes `x-api-key` (Anthropic's header) or `Authorization: Bearer`. The
`anthropic-version` and `anthropic-beta` headers are accepted and need not be sent: the
API surface served is the one the installed `anthropic` SDK types. Errors, here and on
every /v1/messages path, take Anthropic's shape (`anthropic_error_response`).
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from once.gateway.apis.messages.events import MessagesEncoder
from once.gateway.front.door import FrontDoor
from once.gateway.front.http_admit import admit_http
from once.gateway.front.http_reply import reply
from once.gateway.front.sse import sse_chunk
from once.protocol.errors import OnceError, RateLimitError
from once.protocol.messages import parse_count_tokens_request, parse_messages_request

TRANSPORT = "http"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_response(
    error: OnceError, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = ERROR_TYPES.get(error.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    headers = dict(headers or {})
    if isinstance(error, RateLimitError):
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse(body, status_code=error.status, headers=headers)


def authorization_of(http: Request) -> str | None:
    api_key = http.headers.get("x-api-key")
    return f"Bearer {api_key}" if api_key else http.headers.get("authorization")


def messages_routes(door: FrontDoor) -> APIRouter:
    pipeline = door.pipeline
    router = APIRouter()

    async def admit(http: Request, parse=parse_messages_request):
        return await admit_http(door, http, parse, api="messages", authorization=authorization_of)

    @router.post("/v1/messages")
    async def create_message(http: Request):
        admission = await admit(http)
        prepared = await pipeline.prepare(admission)
        encoder = MessagesEncoder(
            prepared.request, prepared.response_id, len(prepared.built.prompt_ids)
        )
        return await reply(door, prepared, encoder, sse_chunk, anthropic_error_response, http)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(http: Request):
        admission = await admit(http, parse_count_tokens_request)
        return {"input_tokens": await pipeline.count_prompt_tokens(admission)}

    return router
