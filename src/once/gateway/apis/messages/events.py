"""The Anthropic Messages encoder: neutral output events in, Messages stream events out.

The sequence is Anthropic's: `message_start` (then one `ping`), per content block
`content_block_start` / `content_block_delta` (`text_delta`, or one `input_json_delta`
holding a tool call's whole input: calls are parsed whole) / `content_block_stop`, then
`message_delta` with the stop reason and the usage, and `message_stop`. A failure
mid-stream is an `error` event with Anthropic's error shape.

Usage: `cache_read_input_tokens` is the prompt the engine found in its prefix cache and
`input_tokens` the rest, which it computed; once caches every prefix with no write step
a client pays for, so `cache_creation_input_tokens` is 0 and the three add up to the
prompt, as in Anthropic's accounting. `message_start` is sent before the engine has
answered, so its usage counts the whole prompt as input; `message_delta` carries the
final figures.
"""

import json

from once.gateway.output import (
    FAILED,
    INCOMPLETE,
    ItemEmitted,
    MessageClosed,
    MessageOpened,
    OutputEvent,
    OutputTextDelta,
    ResponseFinished,
    ResponseStarted,
    Usage,
)
from once.protocol.responses import ResponsesRequest

STOP_REASONS = {"max_output_tokens": "max_tokens", "content_filter": "refusal"}


def messages_usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.input_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.output_tokens,
    }


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


class MessagesEncoder:
    def __init__(self, request: ResponsesRequest, response_id: str, num_prompt_tokens: int):
        self.id = "msg_" + response_id.removeprefix("resp_")
        self.model = request.model
        self.num_prompt_tokens = num_prompt_tokens
        self.content: list[dict] = []
        self.finished: ResponseFinished | None = None

    def encode(self, events: list[OutputEvent]) -> list[dict]:
        wire: list[dict] = []
        for event in events:
            if isinstance(event, OutputTextDelta):
                self.content[-1]["text"] += event.text
                delta = {"type": "text_delta", "text": event.text}
                wire.append(self._block_event("content_block_delta", delta=delta))
            elif isinstance(event, ResponseStarted):
                wire.append({"type": "message_start", "message": self._message(None)})
                wire.append({"type": "ping"})
            elif isinstance(event, MessageOpened):
                self.content.append({"type": "text", "text": ""})
                block = {"type": "text", "text": ""}
                wire.append(self._block_event("content_block_start", content_block=block))
            elif isinstance(event, MessageClosed):
                wire.append(self._block_event("content_block_stop"))
            elif isinstance(event, ItemEmitted) and event.item["type"] == "function_call":
                wire.extend(self._tool_use(event.item))
            elif isinstance(event, ResponseFinished):
                wire.extend(self._finished(event))
        return wire

    def _block_event(self, kind: str, **fields) -> dict:
        return {"type": kind, "index": len(self.content) - 1, **fields}

    def _tool_use(self, item: dict) -> list[dict]:
        block = {"type": "tool_use", "id": item["call_id"], "name": item["name"]}
        self.content.append({**block, "input": tool_input(item["arguments"])})
        delta = {"type": "input_json_delta", "partial_json": item["arguments"]}
        return [
            self._block_event("content_block_start", content_block={**block, "input": {}}),
            self._block_event("content_block_delta", delta=delta),
            self._block_event("content_block_stop"),
        ]

    def _finished(self, event: ResponseFinished) -> list[dict]:
        self.finished = event
        if event.status == FAILED:
            message = (event.error or {}).get("message", "the response failed")
            return [{"type": "error", "error": {"type": "api_error", "message": message}}]
        delta = {"stop_reason": self.stop_reason(), "stop_sequence": event.stop_sequence}
        return [
            {"type": "message_delta", "delta": delta, "usage": messages_usage(event.usage)},
            {"type": "message_stop"},
        ]

    def stop_reason(self) -> str | None:
        event = self.finished
        if event is None:
            return None
        if event.status == INCOMPLETE:
            return STOP_REASONS.get(event.reason or "", "end_turn")
        if any(block["type"] == "tool_use" for block in self.content):
            return "tool_use"
        return "stop_sequence" if event.stop_sequence else "end_turn"

    def _message(self, usage: Usage | None) -> dict:
        finished = self.finished
        if usage is None:
            usage = Usage(self.num_prompt_tokens, 0, 0)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [dict(block) for block in self.content],
            "stop_reason": self.stop_reason(),
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": messages_usage(usage),
        }

    def store_failed(self, wire: list[dict], error: dict) -> None:
        return None  # this API's responses are never stored (store=False)

    def keep_alive(self) -> list[dict]:
        return [{"type": "ping"}]  # Anthropic's own keep-alive, skipped by its clients

    def api_object(self) -> dict:
        """The message of a non-streaming request (after the final event)."""
        assert self.finished is not None
        return self._message(self.finished.usage)
