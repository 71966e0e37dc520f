"""The incremental rule of WebSocket mode: when a request may go as only its new items.

A request continues the previous one when every non-input field but `metadata` is
unchanged (metadata goes with each call; it is not part of the prompt) and its
input is the previous input, then the previous output, then new items. Then the client
sends `{previous_response_id, input: new items}` (once's WebSocket mode inherits the
omitted fields from the previous response on the connection); otherwise the full request.
Items are compared by value (canonical JSON), so equal items built separately match.
"""

from collections.abc import Sequence
from typing import Any

from once.protocol.responses import canonical_json

# Why a call went in full (the cache doctor and the replay ledger name these).
FIRST_CALL = "first_call"
INPUT_NOT_A_LIST = "input_not_a_list"
FIELDS_CHANGED = "fields_changed"  # model, instructions, tools, ... differ
HISTORY_EDITED = "history_edited"  # an item of the previous input was changed or dropped
OUTPUT_NOT_KEPT = "output_not_kept"  # the previous output is not appended verbatim
# Sent with every call, incremental or not, and free to change between calls: they do not
# enter the prompt (metadata carries the harness's tool pause hints, protocol/pause_hints.py).
PER_CALL_FIELDS = ("metadata",)


def full_request_reason(
    previous: dict | None, previous_output: Sequence[dict] | None, request: dict
) -> str | None:
    """None when `request` may be sent incrementally; else why not."""
    if "previous_response_id" in request:
        raise ValueError("the rule takes a full request, not an incremental one")
    if previous is None:
        return FIRST_CALL
    if not isinstance(request.get("input"), list) or not isinstance(previous.get("input"), list):
        return INPUT_NOT_A_LIST
    if canonical_json(_inherited_fields(previous)) != canonical_json(_inherited_fields(request)):
        return FIELDS_CHANGED
    previous_input, current_input = previous["input"], request["input"]
    if not same_items(previous_input, current_input[: len(previous_input)]):
        return HISTORY_EDITED
    previous_output = list(previous_output or [])
    kept_output = current_input[len(previous_input) : len(previous_input) + len(previous_output)]
    if not same_items(previous_output, kept_output):
        return OUTPUT_NOT_KEPT
    return None


def incremental_request(
    previous: dict | None,
    previous_output: Sequence[dict] | None,
    request: dict,
    previous_response_id: str,
) -> dict:
    """What to send: the chain link and the new items, or the full request."""
    if full_request_reason(previous, previous_output, request) is not None:
        return request
    assert previous is not None  # a first call (no previous request) is always sent in full
    num_kept = len(previous["input"]) + len(previous_output or [])
    per_call = {key: request[key] for key in PER_CALL_FIELDS if key in request}
    return {
        "previous_response_id": previous_response_id,
        "input": request["input"][num_kept:],
        **per_call,
    }


def non_input_fields(request: dict) -> dict:
    return {key: value for key, value in request.items() if key != "input"}


def _inherited_fields(request: dict) -> dict:
    return {key: value for key, value in non_input_fields(request).items()
            if key not in PER_CALL_FIELDS}  # fmt: skip


def same_items(expected: Sequence[Any], actual: Sequence[Any]) -> bool:
    # Identity first: items shared between calls need no serialization.
    return len(expected) == len(actual) and all(
        a is b or canonical_json(a) == canonical_json(b)
        for a, b in zip(expected, actual, strict=True)
    )
