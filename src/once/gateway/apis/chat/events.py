"""The Chat Completions encoder: neutral output events in, `chat.completion.chunk`s out.

Chunks follow the `openai` SDK's `ChatCompletionChunk`: the first carries the assistant
role, text comes as `delta.content`, each tool call as one `delta.tool_calls` entry with
its index, id, name and whole arguments (calls are parsed whole), and the last as an empty
delta with the `finish_reason`. With `stream_options.include_usage` every chunk carries
`usage: null` and one more chunk with no choices carries the usage. A failure mid-stream
is a chunk holding an OpenAI-style `error` (as vLLM sends it). The SSE stream ends with
`data: [DONE]`.
"""

from once.gateway.front.keep_alive import SSE_COMMENT
from once.gateway.output import (
    FAILED,
    INCOMPLETE,
    ItemEmitted,
    OutputEvent,
    OutputTextDelta,
    ResponseFinished,
    ResponseStarted,
    Usage,
)
from once.protocol.responses import ResponsesRequest

DONE = "[DONE]"


def chat_usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }


def chat_logprobs(logprobs) -> list[dict]:
    """The `ChatCompletionTokenLogprob`s of sampled tokens (output.TextLogprob)."""

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]


def finish_reason(event: ResponseFinished, has_tool_calls: bool) -> str:
    if event.status == INCOMPLETE:
        return {"max_output_tokens": "length", "content_filter": "content_filter"}.get(
            event.reason or "", "stop"
        )
    return "tool_calls" if has_tool_calls else "stop"


class ChatCompletionsEncoder:
    def __init__(
        self, request: ResponsesRequest, response_id: str, created_at: int, include_usage: bool
    ):
        self.id = "chatcmpl-" + response_id.removeprefix("resp_")
        self.model = request.model
        self.created = created_at
        self.include_usage = include_usage
        self.text = ""
        self.tool_calls: list[dict] = []
        self.finished: ResponseFinished | None = None
        self.with_logprobs = request.logprobs is not None
        self.logprobs: list[dict] = []

    def _chunk(self, delta: dict, reason: str | None = None, logprobs=None) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            ],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def encode(self, events: list[OutputEvent]) -> list[dict | str]:
        wire: list[dict | str] = []
        for event in events:
            if isinstance(event, OutputTextDelta):
                self.text += event.text
                entries = chat_logprobs(event.logprobs or ())
                self.logprobs += entries
                logprobs = {"content": entries, "refusal": None} if self.with_logprobs else None
                wire.append(self._chunk({"content": event.text}, logprobs=logprobs))
            elif isinstance(event, ResponseStarted):
                wire.append(self._chunk({"role": "assistant", "content": "", "refusal": None}))
            elif isinstance(event, ItemEmitted) and event.item["type"] == "function_call":
                wire.append(self._chunk({"tool_calls": [self._tool_call(event.item)]}))
            elif isinstance(event, ResponseFinished):
                wire.extend(self._finished(event))
        return wire

    def _tool_call(self, item: dict) -> dict:
        call = {
            "index": len(self.tool_calls),
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        self.tool_calls.append(call)
        return call

    def _finished(self, event: ResponseFinished) -> list[dict | str]:
        self.finished = event
        if event.status == FAILED:
            error = {"type": "server_error", "param": None, **(event.error or {})}
            return [{"error": error}, DONE]
        wire: list[dict | str] = [self._chunk({}, finish_reason(event, bool(self.tool_calls)))]
        if self.include_usage:
            usage = {**self._chunk({}), "choices": [], "usage": chat_usage(event.usage)}
            wire.append(usage)
        return [*wire, DONE]

    def store_failed(self, wire: list[dict | str], error: dict) -> None:
        return None  # this API's responses are never stored (store=False)

    def keep_alive(self) -> list[bytes]:
        return [SSE_COMMENT]  # no chunk to spare: an SSE comment, framed as is (keep_alive.py)

    def api_object(self) -> dict:
        """The `chat.completion` of a non-streaming request (after the final event)."""
        assert self.finished is not None
        message: dict = {"role": "assistant", "content": self.text or None, "refusal": None}
        if self.tool_calls:
            message["tool_calls"] = [
                {key: value for key, value in call.items() if key != "index"}
                for call in self.tool_calls
            ]
        reason = finish_reason(self.finished, bool(self.tool_calls))
        logprobs = {"content": self.logprobs, "refusal": None} if self.with_logprobs else None
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
            ],
            "usage": chat_usage(self.finished.usage),
        }
