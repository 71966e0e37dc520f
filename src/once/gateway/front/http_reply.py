"""How every HTTP front end answers a prepared response: an SSE stream of the encoder's
events (each write bounded in time, slow_clients.py), or, not streaming, the API's whole
object (or its error, when the response failed in the engine), with the load-report and
ignored-tools headers on both.

A client that leaves ends its response either way. Streaming, Starlette listens for the
ASGI `http.disconnect` beside the stream and closes it. Not streaming, nothing is written
until the end, so nothing would notice: here the response is worked out in a task while
the request's receive channel is watched, and a disconnect cancels the task, which closes
the pipeline's generator and with it aborts the engine request (generation.py). Without
this, an abandoned 14k-token request kept the engine busy for minutes (issue 33).
"""

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from once.gateway.admission.capacity import LOAD_REPORT_HEADER
from once.gateway.front.door import FrontDoor
from once.gateway.front.http_io import IGNORED_TOOLS_HEADER
from once.gateway.front.slow_clients import DeadlineStreamingResponse
from once.gateway.output import FAILED
from once.gateway.pipeline import EventEncoder, Frame
from once.gateway.prepare import Prepared
from once.protocol.errors import OnceError, error_from_dict

TRANSPORT = "http"


def no_frames(events: list) -> None:
    return None


async def reply(
    door: FrontDoor,
    prepared: Prepared,
    encoder: EventEncoder,
    sse_frame: Frame,
    error_writer: Callable[[OnceError], Response],
    http: Request,
) -> Response:
    headers = {LOAD_REPORT_HEADER: door.pipeline.load_report_header()}
    if prepared.request.ignored_tools:
        headers[IGNORED_TOOLS_HEADER] = ", ".join(prepared.request.ignored_tools)
    if prepared.request.stream:
        return DeadlineStreamingResponse(
            door.pipeline.stream(prepared, encoder, TRANSPORT, sse_frame),
            send_timeout_s=door.send_timeout_s,
            on_timeout=door.metrics.client_timeouts.labels("send").inc,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )

    async def work_out() -> None:
        async with aclosing(
            door.pipeline.stream(prepared, encoder, TRANSPORT, no_frames)
        ) as batches:
            async for _ in batches:
                pass

    if not await unless_client_leaves(work_out(), http):
        return Response(status_code=499)  # nobody reads it: the connection is gone
    finished = prepared.output.finished
    if finished is not None and finished.status == FAILED:
        error = {"message": "the response failed", **(finished.error or {})}
        return error_writer(error_from_dict(error))
    return JSONResponse(encoder.api_object(), headers=headers)


async def unless_client_leaves(work: Awaitable[None], http: Request) -> bool:
    """Run `work` to its end (True; its exception raised) or until the client disconnects
    (False: `work` cancelled and waited for, so nothing is left pending)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(client_left(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()  # a no-op on a finished one
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


async def client_left(http: Request) -> None:
    # The body was read in full before, so the channel's next message is the disconnect.
    while (await http.receive())["type"] != "http.disconnect":
        pass
