"""The Responses API objects and stream events a response produces, as plain dicts.

`ResponseBuilder` owns one response object and hands out its events in order, each with
the next `sequence_number`. Shapes follow the official SDK's types (`Response`,
`ResponseStreamEvent`); the tests parse every object and event with them.
"""

import secrets
import time

from once.protocol.responses import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseBuilder:
    def __init__(self, request: ResponsesRequest, response_id: str | None = None):
        self.request = request
        self.sequence_number = 0
        self.response = {
            "id": response_id or new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": request.model,
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": request.tool_choice,
            "tools": list(request.tools),
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None,
            "metadata": request.metadata or {},
        }
        self._open_message: dict | None = None

    @property
    def id(self) -> str:
        return self.response["id"]

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def snapshot(self) -> dict:
        # Events carry the response as it was then, not a reference that later changes.
        return {**self.response, "output": [dict(item) for item in self.response["output"]]}

    def started(self) -> list[dict]:
        return [
            self.event("response.created", response=self.snapshot()),
            self.event("response.in_progress", response=self.snapshot()),
        ]

    # -- message items -------------------------------------------------------------------

    def text_delta(self, text: str) -> list[dict]:
        events = []
        if self._open_message is None:
            self._open_message = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.response["output"].append(self._open_message)
            index = len(self.response["output"]) - 1
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**self._open_message, "content": []},
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open_message["content"].append(part)
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._open_message["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        part = self._open_message["content"][0]
        part["text"] += text
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._open_message["id"],
                output_index=len(self.response["output"]) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def close_message(self, status: str = "completed") -> list[dict]:
        message = self._open_message
        if message is None:
            return []
        self._open_message = None
        index = self.response["output"].index(message)
        part = message["content"][0]
        message["status"] = status
        return [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
            self.event("response.output_item.done", output_index=index, item=dict(message)),
        ]

    # -- function calls ------------------------------------------------------------------

    def function_call(self, name: str, arguments: str) -> list[dict]:
        events = self.close_message()
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": new_id("call"),
            "name": name,
            "arguments": "",
        }
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        # The call is parsed whole (see toolcalls.py), so its arguments arrive in one delta.
        events.append(
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=arguments,
            )
        )
        item["arguments"] = arguments
        item["status"] = "completed"
        events.append(
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=name,
                arguments=arguments,
            )
        )
        events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    # -- the end -------------------------------------------------------------------------

    def finished(
        self, status: str, usage: dict | None, *, reason: str | None = None, error=None
    ) -> list[dict]:
        """status: completed | incomplete (reason) | failed (error dict)."""
        events = self.close_message("completed" if status == "completed" else "incomplete")
        self.response["status"] = status
        self.response["usage"] = usage
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": reason}
        if status == "failed":
            self.response["error"] = error
        events.append(self.event(f"response.{status}", response=self.snapshot()))
        return events

    def error_event(self, code: str, message: str, param: str | None = None) -> dict:
        return self.event("error", code=code, message=message, param=param)


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    # The SDK requires `cache_write_tokens`: the prompt tokens the engine computed, whose
    # KV its prefix cache now holds for the next turn.
    details = {"cached_tokens": cached_tokens, "cache_write_tokens": input_tokens - cached_tokens}
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": details,
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
