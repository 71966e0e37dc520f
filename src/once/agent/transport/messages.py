"""Anthropic Messages transport: the loop's full request as Messages, every call, over the
`anthropic` SDK's streaming client (what Claude Code and Anthropic-API agents speak). The
reply comes back as Responses output items.
"""

import json

import anthropic

from once.agent.transport.base import EventCallback, TransportError, TransportStats
from once.agent.transport.convert import messages_request, output_items, response_dict

DEFAULT_MAX_TOKENS = 4096  # Messages requires max_tokens; the loop's requests may omit it


class MessagesTransport:
    def __init__(self, client: anthropic.AsyncAnthropic, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.client = client
        self.max_tokens = max_tokens
        self.stats = TransportStats()

    async def create(self, request: dict, on_event: EventCallback | None = None) -> dict:
        body = messages_request(request, self.max_tokens)
        self.stats.calls += 1
        self.stats.count_sent(body)
        emit = on_event or (lambda event: None)
        try:
            async with self.client.messages.stream(**body) as stream:
                async for event in stream:
                    if event.type == "text":
                        emit({"type": "response.output_text.delta", "delta": event.text})
                    elif event.type == "input_json":
                        emit({"type": "response.function_call_arguments.delta"})
                    elif event.type == "message_start":
                        emit({"type": "response.created"})
                message = await stream.get_final_message()
        except anthropic.APIStatusError as e:
            error = (e.body or {}).get("error", {}) if isinstance(e.body, dict) else {}
            raise TransportError(e.message, error.get("type"), 0, from_server=True) from e
        except anthropic.APIError as e:  # an error event mid-stream
            raise TransportError(e.message, "api_error", 1) from e
        text = "".join(block.text for block in message.content if block.type == "text")
        calls = [
            (block.id, block.name, json.dumps(block.input, ensure_ascii=False))
            for block in message.content
            if block.type == "tool_use"
        ]
        used = message.usage
        cached = used.cache_read_input_tokens or 0
        usage = {
            "input_tokens": used.input_tokens + cached + (used.cache_creation_input_tokens or 0),
            "output_tokens": used.output_tokens,
            "input_tokens_details": {"cached_tokens": cached},
        }
        return response_dict(output_items(text, calls), usage)

    async def close(self) -> None:
        return None  # the client is its owner's to close
