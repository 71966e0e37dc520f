"""Chat Completions over HTTP: `POST /v1/chat/completions`, JSON or SSE, on the pipeline.

The request adapter is protocol/chat.py, the encoder apis/chat/events.py; everything between
(auth, limits, rendering and incremental state, safety, detokenization, tool-call
parsing, stop strings, metrics) is the same pipeline as the Responses API's.
"""

import json

from fastapi import APIRouter, Request

from once.gateway.apis.chat.events import ChatCompletionsEncoder
from once.gateway.front.door import FrontDoor
from once.gateway.front.http_admit import admit_http
from once.gateway.front.http_io import error_response
from once.gateway.front.http_reply import reply
from once.protocol.chat import include_usage, parse_chat_request


def sse_data(events: list[dict | str | bytes]) -> bytes:
    # Chat Completions' SSE has no `event:` lines: `data: <json>` frames, then `data: [DONE]`;
    # bytes are a frame already (the keep-alive comment).
    return b"".join(_frame(event) for event in events)


def _frame(event: dict | str | bytes) -> bytes:
    if isinstance(event, bytes):
        return event
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def chat_routes(door: FrontDoor) -> APIRouter:
    pipeline = door.pipeline
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(http: Request):
        admission = await admit_http(door, http, parse_chat_request, api="chat")
        prepared = await pipeline.prepare(admission)
        encoder = ChatCompletionsEncoder(
            prepared.request,
            prepared.response_id,
            prepared.created_at,
            include_usage(admission.body),
        )
        return await reply(door, prepared, encoder, sse_data, error_response, http)

    return router
