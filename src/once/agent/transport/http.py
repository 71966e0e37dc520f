"""Stateless HTTP+SSE transport: the full request every call (and the WebSocket fallback)."""

import openai
from openai import AsyncOpenAI

from once.agent.transport.base import EventCallback, TransportError, TransportStats

TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class HttpTransport:
    def __init__(self, client: AsyncOpenAI):
        self.client = client
        self.stats = TransportStats()

    async def create(self, request: dict, on_event: EventCallback | None = None) -> dict:
        self.stats.calls += 1
        self.stats.count_sent(request)
        return await stream_over_http(self.client, request, on_event)

    async def close(self) -> None:
        return None


async def stream_over_http(
    client: AsyncOpenAI, request: dict, on_event: EventCallback | None
) -> dict:
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
