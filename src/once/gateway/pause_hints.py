"""Tool pause hints: the harness says how long its tools take, the engine keeps KV for it.

The wire format (a JSON table of tool -> seconds in the request's `metadata`) is
protocol/pause_hints.py's, shared with the harness. When a response completes, the gateway
takes the longest estimate among the tools it called (a harness runs them one after the
other or side by side; the longest is what a side-by-side run waits for and a lower bound
of a sequential one), and sends `pause_session(prompt_cache_key, seconds)` to the engine
(protocol.engine.SessionPauseHints). Without `prompt_cache_key`, or for an engine that
takes no hints, nothing is sent; nor for a response without a tool call when there is no
`(reply)`: the agent is done, or waits for its user.
"""

import json
import logging
from collections.abc import Coroutine
from typing import Any

from once.protocol.engine import is_seconds
from once.protocol.errors import InvalidRequestError
from once.protocol.pause_hints import ANY_TOOL, METADATA_KEY, TEXT_REPLY

logger = logging.getLogger(__name__)

# Call items and the name their harness knows the tool by.
_NAMED_CALLS = ("function_call", "custom_tool_call")
_TYPED_CALLS = ("shell_call", "local_shell_call", "apply_patch_call")
PARAM = f"metadata.{METADATA_KEY}"


def pause_table(metadata: dict | None) -> dict[str, float] | None:
    """The request's tool -> seconds table, or None; InvalidRequestError when malformed."""
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        return None
    raw = metadata[METADATA_KEY]
    try:
        table = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        table = None
    if not isinstance(table, dict):
        raise InvalidRequestError(
            f"{PARAM} must be a JSON object (as a string) of tool name -> seconds", param=PARAM
        )
    for name, seconds in table.items():
        if not is_seconds(seconds):
            raise InvalidRequestError(
                f"{PARAM}: the pause of {name!r} must be seconds >= 0, got {seconds!r}",
                param=PARAM,
            )
    return {name: float(seconds) for name, seconds in table.items()}


def expected_pause_s(table: dict[str, float], items: list[dict]) -> float | None:
    """Seconds the session is expected to pause after a response with these output items."""
    called = [
        item.get("name") if item.get("type") in _NAMED_CALLS else item.get("type")
        for item in items
        if item.get("type") in _NAMED_CALLS + _TYPED_CALLS
    ]
    if not called:
        return table.get(TEXT_REPLY)
    known = [table.get(str(name), table.get(ANY_TOOL)) for name in called]
    estimates = [seconds for seconds in known if seconds is not None]
    return max(estimates) if estimates else None


def pause_hint(request, items: list[dict], engine) -> Coroutine[Any, Any, None] | None:
    """The engine call that sends a completed response's hint, or None when there is none."""
    pause = getattr(engine, "pause_session", None)
    if pause is None or not request.prompt_cache_key or not request.generate:
        return None
    table = pause_table(request.metadata)
    seconds = None if table is None else expected_pause_s(table, items)
    if seconds is None:
        return None
    return _send(pause, request.prompt_cache_key, seconds)


async def _send(pause, session_key: str, seconds: float) -> None:
    try:
        await pause(session_key, seconds)
    except Exception:  # noqa: BLE001 - a hint lost costs a cache miss, never the response
        logger.warning("pause hint for session %r failed", session_key, exc_info=True)
