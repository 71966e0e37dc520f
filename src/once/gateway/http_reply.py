"""How every HTTP front end answers a prepared response: an SSE stream of the encoder's
events (each write bounded in time, slow_clients.py), or, not streaming, the API's whole
object (or its error, when the response failed in the engine), with the load-report and
ignored-tools headers on both."""

from collections.abc import Callable
from contextlib import aclosing

from fastapi.responses import JSONResponse, Response

from once.gateway.capacity import LOAD_REPORT_HEADER
from once.gateway.http_io import IGNORED_TOOLS_HEADER
from once.gateway.output import FAILED
from once.gateway.pipeline import EventEncoder, Frame, ResponsePipeline
from once.gateway.prepare import Prepared
from once.gateway.slow_clients import DeadlineStreamingResponse
from once.protocol.errors import OnceError, error_from_dict

TRANSPORT = "http"


def no_frames(events: list) -> None:
    return None


async def reply(
    pipeline: ResponsePipeline,
    prepared: Prepared,
    encoder: EventEncoder,
    sse_frame: Frame,
    error_writer: Callable[[OnceError], Response],
) -> Response:
    headers = {LOAD_REPORT_HEADER: pipeline.load_report_header()}
    if prepared.request.ignored_tools:
        headers[IGNORED_TOOLS_HEADER] = ", ".join(prepared.request.ignored_tools)
    if prepared.request.stream:
        return DeadlineStreamingResponse(
            pipeline.stream(prepared, encoder, TRANSPORT, sse_frame),
            send_timeout_s=pipeline.send_timeout_s,
            on_timeout=pipeline.metrics.client_timeouts.labels("send").inc,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )
    async with aclosing(pipeline.stream(prepared, encoder, TRANSPORT, no_frames)) as batches:
        async for _ in batches:
            pass
    finished = prepared.output.finished
    if finished is not None and finished.status == FAILED:
        error = {"message": "the response failed", **(finished.error or {})}
        return error_writer(error_from_dict(error))
    return JSONResponse(encoder.api_object(), headers=headers)
