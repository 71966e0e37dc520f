"""Recorded agent sessions as the WebSocket frames a Codex-like client sends.

Each recorded session (bench/traces.py) becomes the `response.create` frames of its main
chain, at most `calls_per_session` of them: the first call in full, every later call as
`{previous_response_id, input: new items}` where the incremental rule allows (the
harness's own rule.py, as payloads.py applies it), else in full again. `store` is false,
as Codex sends it: the connection's cache is the only state, so memory held per session
must go when its connection closes.

Every replay of a session is a new task: its first user message gets a marker of its
own, so two replays of one recording share the harness's instructions but not their
conversation (the stateless prefix states see as many distinct conversations as real
traffic would, and must stay within their bounds).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from once.agent.transport.rule import full_request_reason, incremental_request
from once.bench.payloads import chains, messages_to_request, output_to_items, session_tools
from once.bench.traces import Session, load_sessions
from once.model_files import DEFAULT_MODEL

# Frames that continue the previous response carry this until the client knows its id.
PREVIOUS = "<previous response id>"


@dataclass(frozen=True)
class ReplayScript:
    session_id: str
    frames: tuple[dict, ...]  # response.create frames, in order

    def frames_for(self, replay: int) -> list[dict]:
        """The frames of one replay: the first user message marked with its number."""
        frames = [dict(frame) for frame in self.frames]
        first = frames[0]
        first["input"] = copy.deepcopy(first["input"])
        for item in first["input"]:
            if item.get("type") == "message" and item.get("role") == "user":
                item["content"] = f"[task {replay}] {item['content']}"
                break
        return frames


def replay_scripts(
    *, calls_per_session: int = 6, max_request_chars: int = 60_000, limit: int | None = None
) -> list[ReplayScript]:
    """One script per recorded session with at least two calls that fit the bounds."""
    scripts = []
    for session in load_sessions(limit=limit):
        frames = session_frames(session, calls_per_session, max_request_chars)
        if len(frames) >= 2:
            scripts.append(ReplayScript(session.session_id, tuple(frames)))
    if not scripts:
        raise ValueError("no recorded session has two calls within the bounds")
    return scripts


def session_frames(session: Session, calls_per_session: int, max_request_chars: int) -> list[dict]:
    tools = session_tools(session)
    first_chain = next(iter(chains(session).values()))
    frames: list[dict] = []
    previous: tuple[dict, list[dict]] | None = None
    for position in first_chain[:calls_per_session]:
        call = session.calls[position]
        request = messages_to_request(call.messages, model=DEFAULT_MODEL, tools=tools)
        output = output_to_items(call.output)
        if len(str(request)) > max_request_chars:
            break
        request = {**request, "store": False}
        if previous is not None and full_request_reason(*previous, request) is None:
            frame = incremental_request(*previous, request, PREVIOUS)
        else:
            frame = request
        frames.append({"type": "response.create", **frame})
        previous = (request, output)
    return frames
