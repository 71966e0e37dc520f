"""WebSocket mode on /v1/responses: one persistent connection, many responses.

The client sends `{"type": "response.create", ...}` text frames with the fields of
`POST /v1/responses` and receives the same events as text frames. One response is in
flight per connection; a second `response.create` meanwhile gets an error frame and the
first one carries on. The connection keeps its own conversation states, so
`previous_response_id` plus only the new items continues a chain even with
`store: false`.

once's continuation rule: a `response.create` whose `previous_response_id` names a
response of this connection inherits every field it omits (model, instructions, tools,
sampling, ...) from that response's request. So an incremental request is exactly
`{previous_response_id, input: new items}`; sending a field changes it.

Errors are frames `{"type": "error", "status": 400, "error": {type, code, message,
param}}`; bad frames never close the connection. It closes itself, with
`websocket_connection_limit_reached`, at the first request after its age limit, and with
code 1008 when a frame is not taken within `send_timeout_s` (a client that stopped
reading): the response's engine request is aborted on the way out.
"""

import asyncio
import contextlib
import functools
import json
import logging
import time
from contextlib import aclosing

from fastapi import WebSocket, WebSocketDisconnect
from websockets.exceptions import ConnectionClosed

from once.gateway.apis.responses.http import responses_encoder
from once.gateway.front.door import FrontDoor
from once.gateway.front.http_io import decode_json
from once.gateway.state.conversation import ConnectionCache
from once.protocol.errors import (
    ConnectionLimitError,
    InvalidRequestError,
    OnceError,
    PreviousResponseNotFoundError,
    ResponseInFlightError,
)
from once.protocol.responses import parse_request

logger = logging.getLogger(__name__)
TRANSPORT = "websocket"
parse_websocket_request = functools.partial(parse_request, websocket=True)
# Fields that belong to one message, never inherited by the next.
_PER_MESSAGE = ("type", "input", "previous_response_id", "generate", "stream", "stream_id")
# What a continuation of a *stored* response (another connection's) inherits from it.
_INHERITED_FROM_STORED = (
    "model",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "prompt_cache_key",
    "store",
)


class SlowReaderError(Exception):
    """A frame was not taken within the send timeout."""


def error_frame(error: OnceError, stream_id: str | None = None) -> dict:
    frame = {"type": "error", "status": error.status, "error": error.to_dict()}
    if stream_id is not None:
        frame["stream_id"] = stream_id
    return frame


def encode_frame(frame: dict) -> str:
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)


class _Connection:
    def __init__(self, door: FrontDoor, socket: WebSocket):
        self.door = door
        self.pipeline = door.pipeline
        self.socket = socket
        self.opened = time.monotonic()
        self.cache = ConnectionCache()
        self.send_lock = asyncio.Lock()
        self.inflight: asyncio.Task | None = None
        self.authorization = socket.headers.get("authorization")

    async def send(self, frame: dict) -> None:
        await self.send_texts([encode_frame(frame)])

    async def send_texts(self, texts: list[str]) -> None:
        async with self.send_lock:
            for text in texts:
                try:
                    async with asyncio.timeout(self.door.send_timeout_s):
                        await self.socket.send_text(text)
                except TimeoutError:
                    raise SlowReaderError from None

    async def drop_slow_reader(self) -> None:
        self.door.metrics.client_timeouts.labels("send").inc()
        logger.warning("a WebSocket client took no frame for %.3g s", self.door.send_timeout_s)
        # The close frame may not get through either: the server's close timeout then
        # aborts the TCP connection.
        with contextlib.suppress(WebSocketDisconnect, ConnectionClosed, RuntimeError):
            await self.socket.close(code=1008)

    async def serve(self) -> None:
        try:
            self.door.keyring.authenticate(self.authorization)
        except OnceError as e:
            await self.send(error_frame(e))
            await self.socket.close(code=1008)
            return
        while True:
            message = await self.socket.receive()
            if message["type"] == "websocket.disconnect":
                return
            received_at = time.perf_counter()
            text = message.get("text")
            if text is None:
                await self.send(error_frame(InvalidRequestError("binary frames are not supported")))
                continue
            self.door.metrics.received_bytes.labels(TRANSPORT).inc(len(text.encode()))
            try:
                frame = self._decode(text)
            except OnceError as e:
                await self.send(error_frame(e))
                continue
            stream_id = frame.get("stream_id")
            if self.inflight is not None and not self.inflight.done():
                busy = ResponseInFlightError("a response is already in progress on this connection")
                await self.send(error_frame(busy, stream_id))
                continue
            if time.monotonic() - self.opened > self.door.websocket_max_age_s:
                limit = ConnectionLimitError(
                    f"this connection is older than {self.door.websocket_max_age_s:.0f} s; "
                    "open a new one (continue with previous_response_id)"
                )
                await self.send(error_frame(limit, stream_id))
                await self.socket.close(code=1000)
                return
            self.inflight = asyncio.create_task(self._respond(frame, stream_id, received_at))

    def _decode(self, text: str) -> dict:
        frame = decode_json(text, "frame")
        if not isinstance(frame, dict):
            raise InvalidRequestError("a frame must be a JSON object", param="type")
        if frame.get("type") != "response.create":
            raise InvalidRequestError(
                f"unknown client event type {frame.get('type')!r}; expected 'response.create'",
                param="type",
            )
        return frame

    async def _respond(self, frame: dict, stream_id: str | None, received_at: float) -> None:
        pipeline = self.pipeline
        body = {k: v for k, v in frame.items() if k not in ("type", "stream_id")}

        def frames(events: list[dict]) -> list[str]:
            if stream_id is not None:
                for event in events:
                    event["stream_id"] = stream_id
            return [encode_frame(event) for event in events]

        try:
            admission = await pipeline.admit(
                body,
                self.authorization,
                transport=TRANSPORT,
                received_at=received_at,
                parse=parse_websocket_request,
                inherit=self._inherit,
            )
            prepared = await pipeline.prepare(admission, self.cache)
            # Known before the first event: the client may continue the moment it sees the
            # last one.
            inherited = {k: v for k, v in admission.body.items() if k not in _PER_MESSAGE}
            self.cache.remember_fields(prepared.response_id, inherited)
            encoder = responses_encoder(prepared)
            batches = pipeline.stream(prepared, encoder, TRANSPORT, frames)
            async with aclosing(batches):
                async for texts in batches:
                    await self.send_texts(texts)
        except OnceError as e:
            await self.send(error_frame(e, stream_id))
        except (WebSocketDisconnect, ConnectionClosed, RuntimeError):
            pass  # the client went away mid-stream; the engine request is aborted
        except SlowReaderError:
            await self.drop_slow_reader()  # the stream is closed: its engine request aborted
        except Exception as e:  # noqa: BLE001 - a bug; the client still gets its answer
            logger.exception("unexpected error answering a response.create")
            failure = OnceError(f"internal error: {type(e).__name__}")
            with contextlib.suppress(WebSocketDisconnect, ConnectionClosed, RuntimeError):
                await self.send(error_frame(failure, stream_id))

    async def _inherit(self, body: dict) -> dict:
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return body
        if previous in self.cache.fields:
            return {**self.cache.fields[previous], **body}
        tenant = self.door.keyring.authenticate(self.authorization)
        record = await self.door.store.get(previous, tenant.name)
        if record is None:
            raise PreviousResponseNotFoundError(
                f"previous response with id {previous!r} not found", param="previous_response_id"
            )
        stored = record.response
        inherited = {k: stored[k] for k in _INHERITED_FROM_STORED if stored.get(k) is not None}
        return {**inherited, **body}

    async def close(self) -> None:
        if self.inflight is not None and not self.inflight.done():
            self.inflight.cancel()
            await asyncio.gather(self.inflight, return_exceptions=True)


async def serve_connection(door: FrontDoor, socket: WebSocket) -> None:
    await socket.accept()
    connection = _Connection(door, socket)
    door.metrics.websocket_connections.inc()
    try:
        await connection.serve()
    except WebSocketDisconnect:
        pass
    finally:
        await connection.close()
        door.metrics.websocket_connections.dec()
