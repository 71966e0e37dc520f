"""A transport without a server: scripted responses from memory, for tests of the loop.

As httpx's `MockTransport` answers requests from a handler, `ScriptedTransport` answers
the n-th call with the n-th scripted response, so a test of the loop's logic (tool calls,
budgets, discovery, compaction, the cache doctor) runs with no gateway, engine or socket:

    transport = ScriptedTransport([function_call("shell", command="ls"), "Done."])
    result = await Agent(transport, registry, ctx, config).run("List the files.")
    transport.requests[1]["input"]  # the second full request, as the loop built it

A script entry is a response dict, one output item (`function_call(...)`), or a string
(an assistant message). Missing ids, status and usage are filled in: ids numbered by call,
usage estimated (`estimate_tokens` of the prompt's canonical JSON in prompt order; cached:
the part it shares with the previous request). Events are streamed as a server sends them
(created, text deltas, the terminal event), and `stats` counts what WebSocket mode would
send, by the same incremental rule (rule.py); `incremental=False` counts as HTTP does.
"""

import copy
import json
from collections.abc import Iterable

from once.agent.prefix import common_prefix_len
from once.agent.tools.schema import estimate_tokens
from once.agent.transport.base import EventCallback, TransportError, TransportStats
from once.agent.transport.rule import incremental_request
from once.protocol.responses import canonical_json

TERMINAL_EVENT_OF_STATUS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def assistant_message(text: str) -> dict:
    return {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_call(name: str, /, **arguments) -> dict:
    """A function_call output item; its call_id is given when it is answered."""
    return {"type": "function_call", "name": name, "arguments": json.dumps(arguments)}


def scripted_response(*output: dict, status: str = "completed", usage: dict | None = None) -> dict:
    response: dict = {"object": "response", "status": status, "output": list(output)}
    if usage is not None:
        response["usage"] = usage
    return response


class ScriptedTransport:
    def __init__(self, script: Iterable[dict | str], *, incremental: bool = True):
        self.script = [_as_response(entry) for entry in script]
        self.incremental = incremental
        self.stats = TransportStats()
        self.requests: list[dict] = []  # every full request, copied as it was sent
        self.closed = False
        self._previous: dict | None = None
        self._previous_output: list[dict] | None = None
        self._previous_id: str | None = None
        self._previous_prompt = ""

    async def create(self, request: dict, on_event: EventCallback | None = None) -> dict:
        call_index = len(self.requests)
        self.requests.append(copy.deepcopy(request))
        self.stats.calls += 1
        self._count(request)
        if call_index >= len(self.script):
            raise TransportError(
                f"the script has {len(self.script)} responses; call {call_index + 1} has none",
                "script_exhausted",
            )
        response = self._answer(call_index, request)
        if on_event is not None:
            _stream(response, on_event)
        if response["status"] != "failed":  # as a server: a failed response is not stored
            self._previous, self._previous_id = request, response["id"]
            self._previous_output = response["output"]
        return response

    async def close(self) -> None:
        self.closed = True

    def _count(self, request: dict) -> None:
        if not self.incremental:
            self.stats.count_sent(request)
            return
        payload = request
        if self._previous_id is not None:
            payload = incremental_request(
                self._previous, self._previous_output, request, self._previous_id
            )
        self.stats.count_sent({"type": "response.create", **payload})

    def _answer(self, call_index: int, request: dict) -> dict:
        response = copy.deepcopy(self.script[call_index])
        response.setdefault("id", f"resp_{call_index + 1}")
        response.setdefault("model", request.get("model"))
        for number, item in enumerate(response["output"], 1):
            item.setdefault("id", f"item_{call_index + 1}_{number}")
            if item.get("type") == "function_call":
                item.setdefault("call_id", f"call_{call_index + 1}_{number}")
        prompt = _prompt_text(request)
        if "usage" not in response:
            cached = prompt[: common_prefix_len(self._previous_prompt, prompt)]
            response["usage"] = {
                "input_tokens": estimate_tokens(prompt),
                "input_tokens_details": {"cached_tokens": estimate_tokens(cached)},
                "output_tokens": estimate_tokens(canonical_json(response["output"])),
            }
        self._previous_prompt = prompt
        return response


def _as_response(entry: dict | str) -> dict:
    if isinstance(entry, str):
        return scripted_response(assistant_message(entry))
    if not isinstance(entry, dict):
        raise TypeError(f"a script entry is a response, an output item or a str: {entry!r}")
    response = (
        {"object": "response", "status": "completed", **entry}
        if "output" in entry
        else (scripted_response(entry))
    )
    if response["status"] not in TERMINAL_EVENT_OF_STATUS:
        raise ValueError(f"a scripted response ends {sorted(TERMINAL_EVENT_OF_STATUS)}")
    return response


def _prompt_text(request: dict) -> str:
    # Prompt order (instructions, tools, then the items), so a longer history shares a
    # prefix with a shorter one as the rendered prompts would.
    parts = [request.get("instructions"), request.get("tools"), *(request.get("input") or [])]
    return "".join(canonical_json(part) for part in parts)


def _stream(response: dict, on_event: EventCallback) -> None:
    created = {"id": response["id"], "object": "response", "status": "in_progress", "output": []}
    on_event({"type": "response.created", "response": created})
    for item in response["output"]:
        if item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if part.get("type") == "output_text":
                delta = {"type": "response.output_text.delta", "item_id": item["id"]}
                on_event({**delta, "delta": part["text"]})
    on_event({"type": TERMINAL_EVENT_OF_STATUS[response["status"]], "response": response})
