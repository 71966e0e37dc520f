"""Deadlines on clients: a request body must arrive, and each write must be taken, in time.

A slowloris (a body trickled in a byte at a time) and a slow reader (a client that stops
reading mid-stream) each hold a connection, and the slow reader an engine request too.

- `BodyDeadline` (plain ASGI middleware): the whole body of an HTTP request must arrive
  within `timeout_s` of its headers, else the read raises `RequestTimeoutError`, a 408
  `request_timeout` like any other error. Waits after the body (for a disconnect) are not
  bounded: a stream is as long as the response.
- `DeadlineStreamingResponse`: each chunk of a streamed response must be taken by the
  transport within `send_timeout_s`. uvicorn's `send` waits while the socket's write
  buffer is above its high-water mark (64 KiB), so the bytes held for one client are
  bounded by that buffer plus the kernel's; a send past the deadline ends the stream,
  which closes the pipeline's generator (its engine request aborted), and the server
  drops the connection it left unfinished.

The headers themselves are uvicorn's to read: it buffers at most one request head per
connection and has no deadline for it, so a client that never finishes its headers holds
one idle socket and nothing else (a proxy in front bounds that, e.g. nginx's
`client_header_timeout`).
"""

import asyncio
import logging
from collections.abc import Callable
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from once.protocol.errors import RequestTimeoutError

logger = logging.getLogger(__name__)


class BodyDeadline:
    def __init__(self, app: ASGIApp, *, timeout_s: float, on_timeout: Callable[[], None]):
        self.app = app
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                self.on_timeout()
                raise RequestTimeoutError(
                    f"the request body did not arrive within {self.timeout_s:g} s"
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, receive_in_time, send)


class DeadlineStreamingResponse(StreamingResponse):
    def __init__(self, content, *, send_timeout_s: float, on_timeout: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self.send_timeout_s = send_timeout_s
        self.on_timeout = on_timeout

    async def stream_response(self, send: Send) -> None:
        # Starlette's loop, with a deadline per chunk and the body closed however it ends.
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        async with aclosing(self.body_iterator) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode()
                try:
                    async with asyncio.timeout(self.send_timeout_s):
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                except TimeoutError:
                    self.on_timeout()
                    logger.warning(
                        "a client took no bytes for %.3g s; its stream ends", self.send_timeout_s
                    )
                    return  # left unfinished: the server closes the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})
