"""Stateless HTTP+SSE transport: the full request every call (and the WebSocket fallback)."""

import json
from collections.abc import Callable
from dataclasses import dataclass

import openai
from openai import AsyncOpenAI

TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


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


def payload_bytes(payload: dict) -> int:
    return len(json.dumps(payload, ensure_ascii=False).encode())


def response_dict(response) -> dict:
    """The SDK's Response as the plain dict the harness keeps (and appends from)."""
    return response.model_dump(mode="json", exclude_none=True)


class HttpTransport:
    def __init__(self, client: AsyncOpenAI):
        self.client = client
        self.stats = TransportStats()

    async def create(self, request: dict, on_event: Callable[[dict], None] | None = None) -> dict:
        self.stats.calls += 1
        self.stats.full_calls += 1
        self.stats.bytes_sent += payload_bytes(request)
        return await stream_over_http(self.client, request, on_event)

    async def close(self) -> None:
        return None


async def stream_over_http(client: AsyncOpenAI, request: dict, on_event) -> dict:
    events = 0
    try:
        stream = await client.responses.create(**request, stream=True)
    except openai.APIStatusError as e:
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        raise TransportError(e.message, code, 0, from_server=True) from e
    except openai.APIConnectionError as e:
        raise TransportError(f"HTTP failed: {e}", None, 0) from e
    try:
        async for event in stream:
            events += 1
            data = event.model_dump(mode="json", exclude_none=True)
            if on_event is not None:
                on_event(data)
            if data["type"] in TERMINAL_EVENTS:
                return data["response"]
            if data["type"] == "error":
                message = data.get("message", "error")
                raise TransportError(message, data.get("code"), events, from_server=True)
    finally:
        await stream.close()  # release the connection even when returning mid-iteration
    raise TransportError("the stream ended before the response did", "stream_ended", events)
