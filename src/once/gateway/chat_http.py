"""Chat Completions over HTTP: `POST /v1/chat/completions`, JSON or SSE, on the pipeline.

The request adapter is protocol/chat.py, the encoder chat_events.py; everything between
(auth, limits, rendering and incremental state, safety, detokenization, tool-call
parsing, stop strings, metrics) is the same pipeline as the Responses API's.
"""

import json
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from once.gateway.capacity import LOAD_REPORT_HEADER
from once.gateway.chat_events import ChatCompletionsEncoder
from once.gateway.http_io import decode_json, error_response, read_body
from once.gateway.pipeline import ResponsePipeline
from once.protocol.chat import include_usage, parse_chat_request
from once.protocol.errors import error_from_dict

TRANSPORT = "http"


def sse_data(events: list[dict | str]) -> bytes:
    # Chat Completions' SSE has no `event:` lines: `data: <json>` frames, then `data: [DONE]`.
    frames = [
        event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        for event in events
    ]
    return "".join(f"data: {frame}\n\n" for frame in frames).encode()


def no_frames(events: list) -> None:
    return None


def chat_routes(pipeline: ResponsePipeline) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(http: Request):
        body = await read_body(http, pipeline.max_body_bytes)
        received_at = time.perf_counter()
        pipeline.metrics.received_bytes.labels(TRANSPORT).inc(len(body))
        decoded = decode_json(body)
        admission = await pipeline.admit(
            decoded,
            http.headers.get("authorization"),
            transport=TRANSPORT,
            received_at=received_at,
            parse=parse_chat_request,
            api="chat",
        )
        prepared = await pipeline.prepare(admission)
        encoder = ChatCompletionsEncoder(
            prepared.request, prepared.response_id, prepared.created_at, include_usage(decoded)
        )
        headers = {LOAD_REPORT_HEADER: pipeline.load_report_header()}
        if admission.request.stream:
            return StreamingResponse(
                pipeline.stream(prepared, encoder, TRANSPORT, sse_data),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        async with aclosing(pipeline.stream(prepared, encoder, TRANSPORT, no_frames)) as batches:
            async for _ in batches:
                pass
        finished = encoder.finished
        if finished is not None and finished.status == "failed":
            return error_response(error_from_dict(finished.error or {}))
        return JSONResponse(encoder.api_object(), headers=headers)

    return router
