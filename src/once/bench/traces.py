"""Loaders for the recorded coding-agent sessions in ../shared/data/agent_traces.

Each loader rebuilds the exact sequence of model requests of one session, as described in
../shared/data/README.md (section agent_traces), and pairs every request with the output the
model actually produced, so a replay can send the same traffic and force the same outputs.

Messages come out in OpenAI chat style: `role` in system/user/assistant/tool, `content` a
str, `tool_calls` on assistant messages and `tool_call_id` on tool messages when recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from once.agent.prefix import common_prefix_len
from once.protocol.errors import InvalidRequestError

MINI_SWE_AGENT = "mini-swe-agent"
CODER = "coder"
SWEAGENT_1_1 = "sweagent-1.1"
SWEAGENT_1_0 = "sweagent-1.0"
SOURCES = (MINI_SWE_AGENT, CODER, SWEAGENT_1_1, SWEAGENT_1_0)

# Only trajectories are sessions; results.json and the like sit in the same folders.
TRAJECTORY_SUFFIXES = (".traj", ".traj.json")

# src/once/bench/traces.py -> the repository root is three folders up from bench/.
_REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Call:
    # Message dicts are shared between the calls of a session (an append-only history
    # would otherwise cost quadratic memory): treat them as read-only.
    index: int
    messages: tuple[dict, ...]  # the exact request
    output: dict  # {"role": "assistant", "content": str, maybe "tool_calls": [...]}
    agent: str | None = None  # CodeR role (Manager, Reproducer, ...); None elsewhere
    usage: dict | None = None  # recorded token usage, where the format stores it


@dataclass(frozen=True)
class Session:
    session_id: str  # "<folder>/<file stem>"
    source: str  # one of SOURCES
    path: Path
    calls: tuple[Call, ...]


def default_traces_dir() -> Path:
    shared_data = os.environ.get("ONCE_SHARED_DATA")
    if shared_data:
        return Path(shared_data) / "agent_traces"
    return _REPO_ROOT.parent / "shared" / "data" / "agent_traces"


def detect_format(path: str | Path) -> str:
    return _detect(_read_json(Path(path)), Path(path))


def load_session(path: str | Path) -> Session:
    path = Path(path)
    data = _read_json(path)
    source = _detect(data, path)
    try:
        calls = tuple(_CALL_BUILDERS[source](data))
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise InvalidRequestError(
            f"{path}: malformed {source} trajectory ({type(exc).__name__}: {exc})"
        ) from exc
    if not calls:
        raise InvalidRequestError(f"{path}: {source} trajectory has no model calls")
    stem = path.name.removesuffix(".json").removesuffix(".traj")
    return Session(session_id=f"{path.parent.name}/{stem}", source=source, path=path, calls=calls)


def load_sessions(
    root: str | Path | None = None, source: str | None = None, limit: int | None = None
) -> list[Session]:
    if source is not None and source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    root = Path(root) if root is not None else default_traces_dir()
    sessions: list[Session] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            if limit is not None and len(sessions) >= limit:
                return sessions
            if not path.name.endswith(TRAJECTORY_SUFFIXES):
                continue
            session = load_session(path)
            if source is None or session.source == source:
                sessions.append(session)
    return sessions


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"{path}: not a JSON trajectory ({exc})") from exc


def _detect(data: Any, path: Path) -> str:
    # Structure decides, not the folder name, so a renamed file still loads.
    if isinstance(data, dict):
        if str(data.get("trajectory_format", "")).startswith("mini-swe-agent") and isinstance(
            data.get("messages"), list
        ):
            return MINI_SWE_AGENT
        trajectory, history = data.get("trajectory"), data.get("history")
        if isinstance(trajectory, list) and isinstance(history, list) and trajectory:
            first_step = trajectory[0]
            if isinstance(first_step, dict) and "query" in first_step:
                return SWEAGENT_1_1
            if isinstance(first_step, dict) and "messages" in first_step:
                return SWEAGENT_1_0
            # SWE-agent 0.x stores no per-step request; CodeR's history tags every entry
            # with the role that spoke, which is what lets us rebuild its requests.
            if history and all(isinstance(e, dict) and "agent" in e for e in history):
                return CODER
    raise InvalidRequestError(
        f"{path}: unknown trajectory format; expected one of {', '.join(SOURCES)}"
    )


def _text(content: Any) -> str:
    # Content is a str or a list of {type: text, text} parts; the model saw them joined.
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if part.get("type") == "text")
    if content is None:
        return ""
    raise TypeError(f"message content of type {type(content).__name__}")


def _plain_message(entry: dict) -> dict:
    return {"role": entry["role"], "content": _text(entry["content"])}


def _mini_swe_agent_calls(data: dict) -> Iterator[Call]:
    # `messages` is strictly append-only: the request of each assistant message is
    # everything before it.
    messages = data["messages"]
    request: list[dict] = []
    num_calls = 0
    for entry in messages:
        message = _plain_message(entry)
        if message["role"] == "assistant":
            usage = (entry.get("extra") or {}).get("response", {}).get("usage")
            yield Call(index=num_calls, messages=tuple(request), output=message, usage=usage)
            num_calls += 1
        request.append(message)


def _coder_calls(data: dict) -> Iterator[Call]:
    # `history` interleaves five role chats; each role's request is its own chat so far,
    # so the prefix breaks whenever the speaking role changes.
    chats: dict[str, list[dict]] = {}
    num_calls = 0
    for entry in data["history"]:
        agent = entry["agent"]
        chat = chats.setdefault(agent, [])
        message = _plain_message(entry)
        if message["role"] == "assistant":
            yield Call(index=num_calls, messages=tuple(chat), output=message, agent=agent)
            num_calls += 1
        chat.append(message)


def _sweagent_message(entry: dict) -> dict:
    # Mirrors SWE-agent's own history-to-messages step (one tool call per observation).
    # `cache_control` is dropped: an Anthropic hint that moves to the newest messages at
    # every call, not content the model reads.
    message = _plain_message(entry)
    if message["role"] == "tool" and entry.get("tool_call_ids"):
        message["tool_call_id"] = entry["tool_call_ids"][0]
    elif entry.get("tool_calls") is not None:
        message["tool_calls"] = entry["tool_calls"]
    return message


def _last_assistant_index(entries: list[dict]) -> int:
    for index in range(len(entries) - 1, -1, -1):
        if entries[index]["role"] == "assistant":
            return index
    raise KeyError("no assistant message")


def _is_exit_step(step: dict) -> bool:
    # When a run ends on an error (context window, cost limit, ...) SWE-agent records a
    # step whose reply it wrote itself ("Exit due to context window"): no model produced it.
    return not step.get("action") and str(step.get("response", "")).startswith("Exit due to")


def _sweagent_calls(
    steps: list[dict], requests: list[list], reply_sources: list[list]
) -> Iterator[Call]:
    # The reply to request k is the newest assistant message of reply_sources[k]. It is not at
    # a fixed position: LM-32B histories elide old observations, and after a format error
    # the failed reply and the error message are dropped again from the next request.
    num_calls = 0
    for step, request, reply_source in zip(steps, requests, reply_sources, strict=True):
        if _is_exit_step(step):
            continue
        yield Call(
            index=num_calls,
            messages=tuple(_sweagent_message(entry) for entry in request),
            output=_sweagent_message(reply_source[_last_assistant_index(reply_source)]),
        )
        num_calls += 1


def _sweagent_1_1_calls(data: dict) -> Iterator[Call]:
    # trajectory[k].query is the request of call k, after history processing; its reply is
    # stored in the request of call k+1, and the last reply only in `history`.
    steps = data["trajectory"]
    requests = [step["query"] for step in steps]
    return _sweagent_calls(steps, requests, requests[1:] + [data["history"]])


def _sweagent_1_0_calls(data: dict) -> Iterator[Call]:
    # trajectory[k].messages is the processed history *after* step k: it already ends with
    # reply k and its observation, so it is the request of call k+1. The request of call 0
    # is the first snapshot cut before its reply.
    steps = data["trajectory"]
    snapshots = [step["messages"] for step in steps]
    first_request = snapshots[0][: _last_assistant_index(snapshots[0])]
    return _sweagent_calls(steps, [first_request] + snapshots[:-1], snapshots)


_CALL_BUILDERS = {
    MINI_SWE_AGENT: _mini_swe_agent_calls,
    CODER: _coder_calls,
    SWEAGENT_1_1: _sweagent_1_1_calls,
    SWEAGENT_1_0: _sweagent_1_0_calls,
}


@dataclass(frozen=True)
class CallStats:
    index: int
    request_chars: int
    shared_chars: int  # common prefix with the previous request of the session

    @property
    def new_chars(self) -> int:
        return self.request_chars - self.shared_chars


def serialize_messages(messages: tuple[dict, ...] | list[dict]) -> str:
    # One canonical text per request, so prefix sharing can be measured in chars before any
    # tokenizer is chosen. JSON escaping makes it slightly longer than a rendered prompt.
    return json.dumps(list(messages), ensure_ascii=False, separators=(",", ":"))


def session_stats(session: Session) -> list[CallStats]:
    stats = []
    previous = ""
    for call in session.calls:
        request = serialize_messages(call.messages)
        stats.append(
            CallStats(
                index=call.index,
                request_chars=len(request),
                shared_chars=common_prefix_len(previous, request),
            )
        )
        previous = request
    return stats
