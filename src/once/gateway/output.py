"""A response's output as the pipeline produces it, before any API gives it a shape.

The pipeline emits these protocol-neutral events; each API's encoder (Responses events,
and the other APIs' chunks) turns them into its own wire events. `OutputBuilder` keeps the
output items in the conversation's canonical form, which is the Responses API's item
shape (a `message` with one `output_text` part, a `function_call`): that is what the
renderer reads back when the conversation continues, and what the store keeps.

Order, always: `ResponseStarted`, then per item either `MessageOpened`, one or more
`OutputTextDelta`, `MessageClosed`, or one `ItemEmitted`, or, for an item the gateway
works on before it is done (an MCP call), `ItemStarted` and later its `ItemEmitted`;
`ResponseFinished` last. Events carry copies of the items, so an encoder may keep them.
"""

import secrets
from dataclasses import dataclass

from once.gateway.prompt.tool_items import CALL_TYPES

COMPLETED = "completed"
INCOMPLETE = "incomplete"  # with a reason: max_output_tokens, content_filter, cancelled
FAILED = "failed"  # with an error {code, message}


# Ids of the call items, as OpenAI prefixes them.
ID_PREFIXES = {
    "function_call": "fc",
    "custom_tool_call": "ctc",
    "tool_search_call": "tsc",
    "local_shell_call": "lsh",
    "shell_call": "sh",
    "apply_patch_call": "apc",
    "program": "prog",
    "program_output": "progo",
    "mcp_call": "mcp",
    "mcp_list_tools": "mcpl",
    "mcp_approval_request": "mcpr",
    "web_search_call": "ws",
    "file_search_call": "fs",
    "code_interpreter_call": "ci",
}
# Call items the SDK types without a call_id, or without a status.
WITHOUT_CALL_ID = (
    "mcp_call", "mcp_approval_request", "web_search_call", "file_search_call",
    "code_interpreter_call",
)  # fmt: skip
WITHOUT_STATUS = ("program", "mcp_approval_request")
# Hosted calls shown in progress while the gateway runs them (the others are done at once).
RUN_IN_PROGRESS = ("mcp_call", "web_search_call", "file_search_call", "code_interpreter_call")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class ResponseStarted:
    response_id: str
    created_at: int


@dataclass(frozen=True)
class MessageOpened:
    output_index: int
    item: dict  # the assistant message, content still empty


@dataclass(frozen=True)
class TextLogprob:
    """One sampled token of the text with its log probability, and the alternatives'."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class OutputTextDelta:
    output_index: int
    item_id: str
    text: str
    # When asked for: the tokens sampled since the last delta (they need not align with
    # `text`, which the detokenizer cuts at character boundaries).
    logprobs: tuple[TextLogprob, ...] | None = None


@dataclass(frozen=True)
class MessageClosed:
    output_index: int
    item: dict  # the whole message, its text complete


@dataclass(frozen=True)
class ItemStarted:
    output_index: int
    item: dict  # an item the gateway works on (status in_progress); its ItemEmitted follows


@dataclass(frozen=True)
class ItemEmitted:
    output_index: int
    item: dict  # a complete item: a call of any kind (calls are parsed whole), or what a
    # tool run by the gateway gave back (tool_search_output, mcp_list_tools, ...)


@dataclass(frozen=True)
class ResponseFinished:
    status: str  # COMPLETED | INCOMPLETE | FAILED
    usage: Usage
    reason: str | None = None  # why INCOMPLETE
    error: dict | None = None  # what FAILED: {code, message}
    stop_sequence: str | None = None  # the stop string that ended a COMPLETED output


OutputEvent = (
    ResponseStarted
    | MessageOpened
    | OutputTextDelta
    | MessageClosed
    | ItemStarted
    | ItemEmitted
    | ResponseFinished
)


class OutputBuilder:
    """One response's output items, handed out as neutral events in order."""

    def __init__(self, response_id: str, created_at: int):
        self.response_id = response_id
        self.created_at = created_at
        self.items: list[dict] = []
        self.finished: ResponseFinished | None = None
        self._open_message: dict | None = None
        self._announced = False
        self._in_progress: set[str] = set()  # ids of started items not done yet

    def started(self) -> list[OutputEvent]:
        """The response's first event, once: later steps of the response start no other."""
        if self._announced:
            return []
        self._announced = True
        return [ResponseStarted(self.response_id, self.created_at)]

    def text(self, text: str, logprobs: tuple[TextLogprob, ...] | None = None) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        message = self._open_message
        if message is None:
            message = self._open_message = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
            }
            self.items.append(message)
            events.append(MessageOpened(len(self.items) - 1, {**message, "content": []}))
        message["content"][0]["text"] += text
        events.append(OutputTextDelta(len(self.items) - 1, message["id"], text, logprobs))
        return events

    def function_call(self, name: str, arguments: str) -> list[OutputEvent]:
        return self.tool_call({"type": "function_call", "name": name, "arguments": arguments})

    def tool_call(self, fields: dict, in_progress: bool = False) -> list[OutputEvent]:
        """A whole call item of any kind (tool_items.py): `fields` without ids or status.
        `in_progress`: the gateway runs it now, and `hosted_items` finishes it."""
        events = self._close_message(COMPLETED)
        kind = fields["type"]
        item = {"id": new_id(ID_PREFIXES.get(kind, "call")), "type": kind}  # the SDK's order
        if kind not in WITHOUT_STATUS:
            item["status"] = "in_progress" if in_progress else "completed"
        if kind not in WITHOUT_CALL_ID:
            item["call_id"] = new_id("call")
        item.update(fields)
        self.items.append(item)
        if in_progress:
            self._in_progress.add(item["id"])
            events.append(ItemStarted(len(self.items) - 1, dict(item)))
        else:
            events.append(ItemEmitted(len(self.items) - 1, dict(item)))
        return events

    def hosted_call(self, fields: dict) -> list[OutputEvent]:
        """A call the gateway runs (hosted/base.py): in progress until its tool finishes it."""
        return self.tool_call(fields, in_progress=fields["type"] in RUN_IN_PROGRESS)

    def hosted_items(self, items: list[dict]) -> list[OutputEvent]:
        """Items a tool run by the gateway gave back, complete, with ids where they lack one;
        one with the id of an item in progress finishes it in place."""
        events = self._close_message(COMPLETED)
        for item in items:
            if item.get("id") in self._in_progress:
                self._in_progress.discard(item["id"])
                index = next(i for i, old in enumerate(self.items) if old["id"] == item["id"])
                self.items[index] = item = dict(item)
                events.append(ItemEmitted(index, dict(item)))
                continue
            item = {"id": new_id(ID_PREFIXES.get(item["type"], "item")), **item}
            self.items.append(item)
            events.append(ItemEmitted(len(self.items) - 1, dict(item)))
        return events

    @property
    def num_client_calls(self) -> int:
        """Calls the client runs (not those of the gateway's hosted tools)."""
        return sum(
            item["type"] in CALL_TYPES and item.get("execution") != "server" for item in self.items
        )

    def discard(self) -> None:
        """Drop everything produced so far (held output the input check refused)."""
        self.items = []
        self._open_message = None

    def finish(
        self,
        status: str,
        usage: Usage,
        *,
        reason: str | None = None,
        error: dict | None = None,
        stop_sequence: str | None = None,
    ) -> list[OutputEvent]:
        events = self._close_message(COMPLETED if status == COMPLETED else INCOMPLETE)
        self.finished = ResponseFinished(status, usage, reason, error, stop_sequence)
        events.append(self.finished)
        return events

    def _close_message(self, status: str) -> list[OutputEvent]:
        message = self._open_message
        if message is None:
            return []
        self._open_message = None
        message["status"] = status
        item = {**message, "content": [dict(part) for part in message["content"]]}
        return [MessageClosed(self.items.index(message), item)]
