"""The Responses API's encoder: neutral output events in, Responses stream events out.

`ResponsesEncoder` owns one response object and hands out its stream events in order,
each with the next `sequence_number`. Shapes follow the official SDK's types (`Response`,
`ResponseStreamEvent`); the tests parse every object and event with them.

Every item is `response.output_item.added`, then what its type streams, then
`response.output_item.done`. Besides a message's text and parts, the SDK streams:
a function call's arguments and a custom call's input (whole, in one delta: calls are
parsed whole); an `mcp_call`'s arguments, `mcp_call.in_progress` while the gateway calls
the server, and `mcp_call.completed` or `.failed`; an `mcp_list_tools`'s `in_progress`
and `completed` or `failed`. An item the gateway works on (output.py's `ItemStarted`) is
added when it starts and done when it ends; one emitted whole gets both at once.
"""

from once.gateway.hosted.backend_tools import BACKEND_CALLS, OUTPUT_FIELD
from once.gateway.output import (
    ItemEmitted,
    ItemStarted,
    MessageClosed,
    MessageOpened,
    OutputEvent,
    OutputTextDelta,
    ResponseFinished,
    ResponseStarted,
    Usage,
)
from once.protocol.responses import ResponsesRequest

IGNORED_TOOLS_FIELD = "once_ignored_tools"
# A response the store failed to keep has `store: false` and the store's error here.
STORE_ERROR_FIELD = "once_store_error"
# Items whose status the SDK types as final only: added as they are done.
FINAL_STATUS_ONLY = ("program_output",)


def response_usage(usage: Usage) -> dict:
    # The SDK requires `cache_write_tokens`: the prompt tokens the engine computed, whose
    # KV its prefix cache now holds for the next turn.
    details = {
        "cached_tokens": usage.cached_tokens,
        "cache_write_tokens": usage.input_tokens - usage.cached_tokens,
    }
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": details,
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


class ResponsesEncoder:
    def __init__(self, request: ResponsesRequest, response_id: str, created_at: int):
        self.sequence_number = 0
        self._started: set[int] = set()  # output indexes of items added, not done yet
        self.response = {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
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
            "text": {"format": request.text_format_spec or {"type": "text"}},
            "tool_choice": request.tool_choice,
            "tools": list(request.tools),
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None,
            "metadata": request.metadata or {},
        }
        if request.ignored_tools:
            # Hosted tools with no backend here: not in the prompt (tool_items.py).
            self.response[IGNORED_TOOLS_FIELD] = list(request.ignored_tools)

    def snapshot(self) -> dict:
        # Events carry the response as it was then, not a reference that later changes.
        return {**self.response, "output": [dict(item) for item in self.response["output"]]}

    def api_object(self) -> dict:
        """The response as GET /v1/responses/{id} and a non-streaming reply return it."""
        return self.snapshot()

    def store_failed(self, wire: list[dict], error: dict) -> None:
        # The terminal event carries a snapshot: it is marked as well as the response.
        for target in [self.response] + [e["response"] for e in wire if "response" in e]:
            target["store"] = False
            target[STORE_ERROR_FIELD] = error

    def keep_alive(self) -> list[dict]:
        # The event Codex's idle timer counts and every client already takes (keep_alive.py).
        return [self._event("response.in_progress", response=self.snapshot())]

    def encode(self, events: list[OutputEvent]) -> list[dict]:
        wire: list[dict] = []
        for event in events:
            wire.extend(self._encode(event))
        return wire

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _encode(self, event: OutputEvent) -> list[dict]:
        if isinstance(event, OutputTextDelta):  # the common case first
            part = self.response["output"][event.output_index]["content"][0]
            part["text"] += event.text
            logprobs = [
                {"token": lp.token, "logprob": lp.logprob,
                 "top_logprobs": [{"token": t, "logprob": v} for t, v in lp.top]}
                for lp in event.logprobs or ()
            ]  # fmt: skip
            # The output part's logprobs carry each token's UTF-8 bytes too (the SDK's
            # `Logprob` requires them there; the delta event's type has no such field).
            part["logprobs"] += [
                {"token": lp.token, "bytes": list(lp.token.encode()), "logprob": lp.logprob,
                 "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": v}
                                  for t, v in lp.top]}
                for lp in event.logprobs or ()
            ]  # fmt: skip
            return [
                self._event(
                    "response.output_text.delta",
                    item_id=event.item_id,
                    output_index=event.output_index,
                    content_index=0,
                    delta=event.text,
                    logprobs=logprobs,
                )
            ]
        if isinstance(event, ResponseStarted):
            return [
                self._event("response.created", response=self.snapshot()),
                self._event("response.in_progress", response=self.snapshot()),
            ]
        if isinstance(event, MessageOpened):
            return self._message_opened(event)
        if isinstance(event, MessageClosed):
            return self._message_closed(event)
        if isinstance(event, ItemStarted):
            self.response["output"].append(dict(event.item))
            self._started.add(event.output_index)
            return self._item_added(event.item, event.output_index)
        if isinstance(event, ItemEmitted):
            return self._function_call(event)
        if isinstance(event, ResponseFinished):
            return self._finished(event)
        raise TypeError(f"not an output event: {event!r}")

    def _message_opened(self, event: MessageOpened) -> list[dict]:
        item = {**event.item, "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.response["output"].append({**item, "content": [part]})
        return [
            self._event("response.output_item.added", output_index=event.output_index, item=item),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=event.output_index,
                content_index=0,
                part=dict(part),
            ),
        ]

    def _message_closed(self, event: MessageClosed) -> list[dict]:
        message, index = event.item, event.output_index
        kept = self.response["output"][index]["content"][0]["logprobs"]
        message["content"][0]["logprobs"] = kept  # the builder keeps text, this encoder these
        self.response["output"][index] = message
        part = message["content"][0]
        return [
            self._event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
            self._event("response.output_item.done", output_index=index, item=dict(message)),
        ]

    def _function_call(self, event: ItemEmitted) -> list[dict]:
        item, index = event.item, event.output_index
        if index in self._started:  # added when the gateway started on it
            self._started.discard(index)
            self.response["output"][index] = item
            return self._item_done(item, index)
        self.response["output"].append(item)
        if item["type"] == "custom_tool_call":
            return self._custom_tool_call(item, index)
        if item["type"] != "function_call":  # other items: added, then done
            return self._item_added(item, index) + self._item_done(item, index)
        added = {**item, "status": "in_progress", "arguments": ""}
        # The call is parsed whole (see toolcalls.py), so its arguments arrive in one delta.
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def _item_added(self, item: dict, index: int) -> list[dict]:
        added = dict(item)
        if "status" in added and item["type"] not in FINAL_STATUS_ONLY:
            added["status"] = "in_progress"
        kind, ids = item["type"], {"item_id": item["id"], "output_index": index}
        if kind == "mcp_list_tools":
            added["tools"] = []
            added.pop("error", None)
        if kind == "mcp_call":
            for name in ("output", "error"):
                added.pop(name, None)
            added["arguments"] = ""
        if kind in BACKEND_CALLS:
            return self._backend_call_added(added, index)
        events = [self._event("response.output_item.added", output_index=index, item=added)]
        if kind == "mcp_call":
            arguments = item["arguments"]
            events += [
                self._event("response.mcp_call_arguments.delta", **ids, delta=arguments),
                self._event("response.mcp_call_arguments.done", **ids, arguments=arguments),
                self._event("response.mcp_call.in_progress", **ids),
            ]
        elif kind == "mcp_list_tools":
            events.append(self._event("response.mcp_list_tools.in_progress", **ids))
        return events

    def _item_done(self, item: dict, index: int) -> list[dict]:
        kind, ids = item["type"], {"item_id": item["id"], "output_index": index}
        events = []
        if kind in ("mcp_call", "mcp_list_tools"):
            ending = "failed" if item.get("error") else "completed"
            events.append(self._event(f"response.{kind}.{ending}", **ids))
        elif kind in BACKEND_CALLS and item.get("status") == "completed":
            events.append(self._event(f"response.{kind}.completed", **ids))  # no .failed
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def _backend_call_added(self, added: dict, index: int) -> list[dict]:
        """A backend's call (hosted/backends.py), in progress: what the SDK streams for it."""
        kind, ids = added["type"], {"item_id": added["id"], "output_index": index}
        added.pop(OUTPUT_FIELD, None)
        code = added.get("code") or ""
        if kind == "code_interpreter_call":
            added.update(code="", outputs=None)
        if kind == "file_search_call":
            added["results"] = None
        if kind == "web_search_call":
            added["action"] = {k: v for k, v in added["action"].items() if k != "sources"}
        events = [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event(f"response.{kind}.in_progress", **ids),
        ]
        if kind == "code_interpreter_call":
            events += [
                self._event("response.code_interpreter_call_code.delta", **ids, delta=code),
                self._event("response.code_interpreter_call_code.done", **ids, code=code),
                self._event("response.code_interpreter_call.interpreting", **ids),
            ]
        else:
            events.append(self._event(f"response.{kind}.searching", **ids))
        return events

    def _custom_tool_call(self, item: dict, index: int) -> list[dict]:
        added = {**item, "status": "in_progress", "input": ""}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event(
                "response.custom_tool_call_input.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["input"],
            ),
            self._event(
                "response.custom_tool_call_input.done",
                item_id=item["id"],
                output_index=index,
                input=item["input"],
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def _finished(self, event: ResponseFinished) -> list[dict]:
        response = self.response
        response["status"] = event.status
        response["usage"] = response_usage(event.usage)
        if event.status == "incomplete":
            response["incomplete_details"] = {"reason": event.reason}
        if event.status == "failed":
            response["error"] = event.error
        return [self._event(f"response.{event.status}", response=self.snapshot())]
