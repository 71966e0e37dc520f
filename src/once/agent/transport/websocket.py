"""The harness's WebSocket session to /v1/responses, on the official SDK's connection.

`client.responses.connect()` gives the connection and the typed events; this class adds
what a harness needs on top:

- The incremental rule (rule.py): `{previous_response_id, input: new items}` when the
  request extends the previous one, else the full request.
- The recovery ladder: `previous_response_not_found` -> send the full input again on
  the same connection; the connection is replaced between turns before the server's age
  limit; when the connection fails before any event of a response arrived (the server
  restarted, the network dropped it), the full request goes over a new connection, and
  when that fails too before any event, over HTTP+SSE; after a partial response nothing
  is replayed (the turn fails with `TransportError`, so no output is ever duplicated).

Where the SDK does not fit: its connection manager reconnects only with an
`on_reconnecting` hook and would then resend queued frames, which could replay a
partially answered request; this class never enables that and decides itself.
"""

import time
from typing import Any, cast

from openai import AsyncOpenAI
from openai.resources.responses.responses import (
    AsyncResponsesConnection,
    AsyncResponsesConnectionManager,
)

from once.agent.transport.base import EventCallback, TransportError, TransportStats
from once.agent.transport.http import TERMINAL_EVENTS, stream_over_http
from once.agent.transport.rule import incremental_request

PREVIOUS_NOT_FOUND = "previous_response_not_found"


class WebSocketTransport:
    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        reconnect_after_s: float = 55 * 60,  # the server's limit is 60 min (OpenAI, once)
        http_fallback: bool = True,
        options: dict | None = None,  # `websockets` connect options (timeouts, pings)
    ):
        self.client = client
        self.options = options or {}
        self.reconnect_after_s = reconnect_after_s
        self.http_fallback = http_fallback
        self.stats = TransportStats()
        self._manager: AsyncResponsesConnectionManager | None = None
        self._connection: AsyncResponsesConnection | None = None
        self._opened_at = 0.0
        self._previous: dict | None = None
        self._previous_output: list[dict] | None = None
        self._previous_id: str | None = None

    async def create(self, request: dict, on_event: EventCallback | None = None) -> dict:
        """Send one full request (the harness's view); return the final response dict."""
        self.stats.calls += 1
        payload = request
        if self._previous_id is not None:
            payload = incremental_request(
                self._previous, self._previous_output, request, self._previous_id
            )
        try:
            response = await self._over_websocket(payload, request, on_event)
        except TransportError as e:
            if e.events_received or e.from_server:
                raise
            response = await self._recover(request, on_event)
        if response.get("status") != "failed":
            # A failed response is not stored: a retry continues from the last good one.
            self._previous = request
            self._previous_output = response.get("output") or []
            self._previous_id = response["id"]
        return response

    async def _recover(self, request: dict, on_event: EventCallback | None) -> dict:
        """The connection failed before any event: a new one and the full request (the
        server may have restarted, losing what the old connection held); when that fails
        before any event too, HTTP+SSE."""
        self.stats.reconnects += 1
        await self._drop_connection()
        try:
            return await self._over_websocket(request, request, on_event)
        except TransportError as e:
            if e.events_received or e.from_server or not self.http_fallback:
                raise
        self.stats.http_fallbacks += 1
        self._count(request)
        await self._drop_connection()
        return await stream_over_http(self.client, request, on_event)

    async def _over_websocket(
        self, payload: dict, request: dict, on_event: EventCallback | None
    ) -> dict:
        connection = await self._ensure_connection()
        self._count(payload)
        try:
            return await self._exchange(connection, payload, on_event)
        except TransportError as e:
            if e.code != PREVIOUS_NOT_FOUND or payload is request:
                raise
        # The server lost the chain (expired, another replica, a new connection with
        # store=false): the full input, on the same connection.
        self.stats.resends += 1
        self._count(request)
        return await self._exchange(connection, request, on_event)

    async def _exchange(
        self, connection: AsyncResponsesConnection, payload: dict, on_event: EventCallback | None
    ) -> dict:
        events = 0
        try:
            await connection.send({"type": "response.create", **payload})
            while True:
                event = await connection.recv()
                events += 1
                data = event.model_dump(mode="json", exclude_none=True)
                if data["type"] == "error":
                    error = data.get("error") or {}
                    # An error frame answers the request as a whole: nothing was streamed.
                    message, code = error.get("message", "error"), error.get("code")
                    raise TransportError(message, code, 0, from_server=True)
                if on_event is not None:
                    on_event(data)
                if data["type"] in TERMINAL_EVENTS:
                    return data["response"]
        except TransportError:
            raise
        except Exception as e:  # noqa: BLE001 - connection closed, network, protocol
            await self._drop_connection()
            raise TransportError(f"WebSocket failed: {type(e).__name__}: {e}", None, events) from e

    def _count(self, payload: dict) -> None:
        self.stats.count_sent({"type": "response.create", **payload})

    async def _ensure_connection(self) -> AsyncResponsesConnection:
        too_old = time.monotonic() - self._opened_at > self.reconnect_after_s
        if self._connection is not None and too_old:
            self.stats.reconnects += 1
            await self._drop_connection()
        if self._connection is None:
            # The SDK types only some of the `websockets` options; it passes on all of them.
            options = cast(Any, self.options)
            manager = self._manager = self.client.responses.connect(
                websocket_connection_options=options
            )
            try:
                self._connection = await manager.__aenter__()
            except Exception as e:  # noqa: BLE001 - refused, TLS, handshake
                self._manager = None
                raise TransportError(f"cannot open the WebSocket: {e}", None, 0) from e
            self._opened_at = time.monotonic()
        return self._connection

    async def _drop_connection(self) -> None:
        manager, self._manager, self._connection = self._manager, None, None
        if manager is not None:
            try:
                await manager.__aexit__(None, None, None)
            except Exception:  # noqa: BLE001 - already closed
                pass

    async def close(self) -> None:
        await self._drop_connection()
