"""The transport seam: how the loop's requests reach a model (httpx's transports, for the
Responses API).

The loop hands every call over as the *full* request (instructions, tools, the whole
history) and gets back the final response as a plain Responses-shaped dict; what goes on
the wire is the transport's business. Three implement `Transport`:

    WebSocketTransport  websocket.py  {previous_response_id, new items} after the first call
    HttpTransport       http.py       the full request every call, over HTTP+SSE
    ScriptedTransport   fake.py       scripted responses from memory, for tests of the loop

Each counts what it sends in one `TransportStats`, so the loop's cost summary reads the
same fields whichever transport ran.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# Each stream event of a response, as a dict (`response.output_text.delta`, ...).
EventCallback = Callable[[dict], None]


class TransportError(Exception):
    """A call that failed in transport or on the server; `code` is the API error code."""

    def __init__(
        self,
        message: str,
        code: str | None = None,
        events_received: int = 0,
        *,
        from_server: bool = False,
    ):
        super().__init__(message)
        self.code = code
        self.events_received = events_received
        # The server answered with an error (a bad request): another transport would get
        # the same answer, so it is not a reason to fall back.
        self.from_server = from_server


@dataclass
class TransportStats:
    calls: int = 0
    bytes_sent: int = 0  # uncompressed JSON of what the client sent
    incremental_calls: int = 0
    full_calls: int = 0
    resends: int = 0  # previous_response_not_found -> the full input again
    reconnects: int = 0
    http_fallbacks: int = 0

    def count_sent(self, body: dict) -> None:
        """One request body (or WebSocket frame) sent: its bytes, and whether it carried
        only new items (a `previous_response_id`) or everything."""
        self.bytes_sent += payload_bytes(body)
        if "previous_response_id" in body:
            self.incremental_calls += 1
        else:
            self.full_calls += 1


def payload_bytes(payload: dict) -> int:
    return len(json.dumps(payload, ensure_ascii=False).encode())


@runtime_checkable
class Transport(Protocol):
    stats: TransportStats

    async def create(self, request: dict, on_event: EventCallback | None = None) -> dict:
        """Send one full request; stream its events to on_event; return the response."""
        ...

    async def close(self) -> None: ...
