"""Recorded agent sessions as OpenAI Responses API traffic, and what WebSocket mode saves.

`traces.py` rebuilds every model call of a session as chat messages; this module turns them
into the Responses request bodies a harness would send, and the output items a server would
return. It also applies the incremental rule of the Responses API's WebSocket mode (as Codex
uses it): when a request only appends to the previous request plus its output, the client
sends `previous_response_id` and the new items instead of the whole conversation.
`session_payload_bytes` counts the bytes of both ways over a whole session.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from statistics import median
from typing import Any

# The incremental rule and the reasons a call goes in full (keys of `full_call_reasons`)
# are the harness transport's own, so the benchmark counts exactly what it sends.
from once.agent.transport.rule import full_request_reason, incremental_request
from once.bench.traces import CODER, SWEAGENT_1_1, Session
from once.model_files import DEFAULT_MODEL
from once.protocol.errors import InvalidRequestError

MAIN_CHAIN = "main"

# SWE-agent 1.1 (Claude sessions) called three tools whose JSON schemas the trajectories do
# not store. RECONSTRUCTION: built the way SWE-agent builds them
# (sweagent/tools/commands.py, Command.get_function_calling_tool) from the tool docs in the
# sessions' replay_config (bundles registry, edit_anthropic, review_on_submit_m), then
# flattened into the Responses API's function-tool shape. Not a byte-exact copy of what was
# sent to Anthropic.
_STR_REPLACE_EDITOR_DOC = (
    "Custom editing tool for viewing, creating and editing files * State is persistent across "
    "command calls and discussions with the user * If `path` is a file, `view` displays the "
    "result of applying `cat -n`. If `path` is a directory, `view` lists non-hidden files and "
    "directories up to 2 levels deep * The `create` command cannot be used if the specified "
    "`path` already exists as a file * If a `command` generates a long output, it will be "
    "truncated and marked with `<response clipped>` * The `undo_edit` command will revert the "
    "last edit made to the file at `path`\n"
    "Notes for using the `str_replace` command: * The `old_str` parameter should match EXACTLY "
    "one or more consecutive lines from the original file. Be mindful of whitespaces! * If the "
    "`old_str` parameter is not unique in the file, the replacement will not be performed. "
    "Make sure to include enough context in `old_str` to make it unique * The `new_str` "
    "parameter should contain the edited lines that should replace the `old_str`\n"
)
SWEAGENT_1_1_TOOLS: tuple[dict, ...] = (
    {
        "type": "function",
        "name": "bash",
        "description": "runs the given command directly in bash",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to execute."}
            },
            "required": ["command"],
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "str_replace_editor",
        "description": _STR_REPLACE_EDITOR_DOC,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "description": "The commands to run. Allowed options are: `view`, `create`, "
                    "`str_replace`, `insert`, `undo_edit`.",
                    "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                },
                "path": {
                    "type": "string",
                    "description": "Absolute path to file or directory, e.g. `/testbed/file.py` "
                    "or `/testbed`.",
                },
                "file_text": {
                    "type": "string",
                    "description": "Required parameter of `create` command, with the content "
                    "of the file to be created.",
                },
                "old_str": {
                    "type": "string",
                    "description": "Required parameter of `str_replace` command containing the "
                    "string in `path` to replace.",
                },
                "new_str": {
                    "type": "string",
                    "description": "Optional parameter of `str_replace` command containing the "
                    "new string (if not given, no string will be added). Required parameter of "
                    "`insert` command containing the string to insert.",
                },
                "insert_line": {
                    "type": "integer",
                    "description": "Required parameter of `insert` command. The `new_str` will "
                    "be inserted AFTER the line `insert_line` of `path`.",
                },
                "view_range": {
                    "type": "array",
                    "description": "Optional parameter of `view` command when `path` points to "
                    "a file. If none is given, the full file is shown. If provided, the file "
                    "will be shown in the indicated line number range, e.g. [11, 12] will show "
                    "lines 11 and 12. Indexing at 1 to start. Setting `[start_line, -1]` shows "
                    "all lines from `start_line` to the end of the file.",
                    "items": {"type": "integer"},
                },
            },
            "required": ["command", "path"],
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "submit",
        "description": "submits the current file",
        "parameters": {"type": "object"},
        "strict": False,
    },
)


def messages_to_request(
    messages: Sequence[dict], *, model: str, tools: list[dict] | None = None
) -> dict:
    request: dict[str, Any] = {"model": model}
    if messages and messages[0].get("role") == "system":
        request["instructions"] = _text(messages[0])
        messages = messages[1:]
    request["input"] = [item for message in messages for item in _message_items(message)]
    if tools:
        request["tools"] = tools
    return request


def output_to_items(output: dict) -> list[dict]:
    if output.get("role") != "assistant":
        raise InvalidRequestError(f"a recorded output has role {output.get('role')!r}")
    return _message_items(output)


def session_tools(session: Session) -> list[dict] | None:
    # Only SWE-agent 1.1 used native tool calls; the other harnesses parse commands out of
    # the reply text, so their requests carry no tools.
    if session.source == SWEAGENT_1_1:
        return [dict(tool) for tool in SWEAGENT_1_1_TOOLS]
    return None


def session_requests(
    session: Session, *, model: str = DEFAULT_MODEL
) -> list[tuple[dict, list[dict]]]:
    tools = session_tools(session)
    return [
        (messages_to_request(call.messages, model=model, tools=tools), output_to_items(call.output))
        for call in session.calls
    ]


def chains(session: Session) -> dict[str, list[int]]:
    # A chain is one conversation whose requests extend each other. CodeR runs five role
    # chats in one session, so each role (Call.agent) is a chain of its own.
    if session.source != CODER:
        return {MAIN_CHAIN: list(range(len(session.calls)))}
    by_role: dict[str, list[int]] = {}
    for position, call in enumerate(session.calls):
        by_role.setdefault(call.agent or MAIN_CHAIN, []).append(position)
    return by_role


def session_payload_bytes(session: Session, *, model: str = DEFAULT_MODEL) -> dict:
    # Stateless HTTP sends every full request body; WebSocket mode sends a response.create
    # event that refers to the previous call of the same chain whenever the rule allows.
    requests = session_requests(session, model=model)
    previous_in_chain: dict[int, int] = {}
    for positions in chains(session).values():
        for earlier, later in zip(positions, positions[1:], strict=False):
            previous_in_chain[later] = earlier
    http_bytes = ws_bytes = num_incremental = 0
    reasons: Counter[str] = Counter()
    for position, (request, _) in enumerate(requests):
        previous_position = previous_in_chain.get(position)
        previous, previous_output = (
            requests[previous_position] if previous_position is not None else (None, None)
        )
        reason = full_request_reason(previous, previous_output, request)
        message = request
        if reason is None:
            assert previous_position is not None  # a chain's first call is sent in full
            response_id = _response_id(session.session_id, previous_position)
            message = incremental_request(previous, previous_output, request, response_id)
            num_incremental += 1
        else:
            reasons[reason] += 1
        http_bytes += _num_bytes(request)
        ws_bytes += _num_bytes({"type": "response.create", **message})
    return {
        "session_id": session.session_id,
        "source": session.source,
        "calls": len(requests),
        "http_bytes": http_bytes,
        "ws_bytes": ws_bytes,
        "ratio": http_bytes / ws_bytes,
        "incremental_calls": num_incremental,
        "full_calls": len(requests) - num_incremental,
        "full_call_reasons": dict(reasons),
    }


def median_ratio_by_source(sessions: Sequence[Session]) -> dict[str, float]:
    ratios: dict[str, list[float]] = {}
    for session in sessions:
        ratios.setdefault(session.source, []).append(session_payload_bytes(session)["ratio"])
    return {source: median(values) for source, values in ratios.items()}


def _message_items(message: dict) -> list[dict]:
    role = message.get("role")
    text = _text(message)
    if role in ("user", "system"):
        return [{"type": "message", "role": role, "content": text}]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidRequestError("a tool message has no tool_call_id", param="tool_call_id")
        return [{"type": "function_call_output", "call_id": call_id, "output": text}]
    if role != "assistant":
        raise InvalidRequestError(f"unknown message role {role!r}", param="role")
    tool_calls = message.get("tool_calls") or []
    items = []
    if text or not tool_calls:
        content = [{"type": "output_text", "text": text, "annotations": []}]
        items.append({"type": "message", "role": "assistant", "content": content})
    items.extend(_function_call_item(tool_call) for tool_call in tool_calls)
    return items


def _function_call_item(tool_call: dict) -> dict:
    function = tool_call.get("function")
    if not isinstance(function, dict) or not isinstance(tool_call.get("id"), str):
        raise InvalidRequestError("a tool call needs an id and a function", param="tool_calls")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):  # some recorders store the parsed object
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "type": "function_call",
        "call_id": tool_call["id"],
        "name": function["name"],
        "arguments": arguments,
    }


def _text(message: dict) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InvalidRequestError(
            f"{message.get('role')!r} message content is a {type(content).__name__}, not a str",
            param="content",
        )
    return content


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _num_bytes(body: dict) -> int:
    return len(json.dumps(body, ensure_ascii=False).encode())


def _response_id(session_id: str, position: int) -> str:
    # Deterministic, and as long as an OpenAI id ("resp_" + 50 hex), so byte counts are fair.
    digest = hashlib.sha256(f"{session_id}#{position}".encode()).hexdigest()
    return "resp_" + digest[:50]
