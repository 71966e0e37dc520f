"""Workloads for the simulator: the Mooncake trace and the recorded agent sessions.

A `SimRequest` is what a replica needs to cost a request: prompt and output lengths and the
chained hashes of the prompt's blocks. Mooncake requests arrive at their recorded times (open
loop). Agent sessions are closed loops: a session's next call arrives `think_s` after its
previous call finished (the tool time), so only session starts are open-loop arrivals.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

MOONCAKE_BLOCK_SIZE = 512
CONVERSATION_TRACE = "conversation_trace_first30min.jsonl"
CHARS_PER_TOKEN = 4  # agent text has no tokenizer here; ~4 chars per BPE token in English/code
_REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float  # for a follow-up call: ignored, it arrives think_s after `after` ends
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[int, ...]
    session_key: str | None = None
    after: str | None = None  # request_id of the call this one follows (closed loop)
    think_s: float = 0.0


def shared_data_dir() -> Path:
    shared = os.environ.get("ONCE_SHARED_DATA")
    return Path(shared) if shared else _REPO_ROOT.parent / "shared" / "data"


def load_mooncake(
    path: str | Path | None = None, *, minutes: float | None = 30.0, limit: int | None = None
) -> list[SimRequest]:
    """Mooncake JSONL: {timestamp (ms), input_length, output_length, hash_ids (512 tokens)}."""
    # One loader for the Mooncake format, shared with the replay instrument.
    from once.bench.production_traces import load_mooncake as read_mooncake

    path = Path(path) if path is not None else shared_data_dir() / "mooncake" / CONVERSATION_TRACE
    requests = [
        SimRequest(
            f"mc-{r.line}",
            r.arrival_s,
            r.num_prompt_tokens,
            max(1, r.num_output_tokens),
            tuple(r.block_hashes),
        )  # fmt: skip
        for r in read_mooncake(path, minutes=minutes, limit=limit)
    ]
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def text_block_hashes(text: str, block_size: int, chars_per_token: int = CHARS_PER_TOKEN):
    """Chained hashes of `text` cut into blocks of block_size * chars_per_token chars (full
    blocks only, as a prefix cache keeps only full blocks)."""
    span = block_size * chars_per_token
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(text) - span + 1, span):
        digest = hashlib.blake2b(parent + text[start : start + span].encode(), digest_size=8)
        parent = digest.digest()
        hashes.append(int.from_bytes(parent, "big"))
    return tuple(hashes)


def load_agent_sessions(
    root: str | Path | None = None,
    *,
    limit: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    session_gap_s: float = 10.0,
    think_s: float = 2.0,
) -> list[SimRequest]:
    """The recorded agent sessions as closed loops; session i starts at i * session_gap_s.

    Prompt tokens are chars / 4 (the blocks are cut from the same text); output tokens are
    the recorded usage where the trace has it, else chars / 4. A CodeR
    session's role chats get one session key each (their prefixes are separate)."""
    from once.bench.payloads import chains  # bench imports agent code; keep it lazy
    from once.bench.traces import load_sessions, serialize_messages

    sessions = load_sessions(root if root is None else Path(root), limit=limit)
    requests: list[SimRequest] = []
    for number, session in enumerate(sessions):
        chain_of = {pos: name for name, positions in chains(session).items() for pos in positions}
        previous: str | None = None
        for position, call in enumerate(session.calls):
            text = serialize_messages(call.messages)
            output = call.output.get("content") or ""
            usage = call.usage or {}
            # Prompt length from the same chars the blocks are cut from, so the two agree.
            num_prompt = len(text) // CHARS_PER_TOKEN
            num_output = int(usage.get("completion_tokens") or 0) or len(output) // CHARS_PER_TOKEN
            request_id = f"{session.session_id}#{position}"
            requests.append(
                SimRequest(
                    request_id=request_id,
                    arrival_s=number * session_gap_s,
                    num_prompt_tokens=max(1, num_prompt),
                    num_output_tokens=max(1, num_output),
                    block_hashes=text_block_hashes(text, block_size),
                    session_key=f"{session.session_id}/{chain_of[position]}",
                    after=previous,
                    think_s=think_s if previous else 0.0,
                )
            )
            previous = request_id
    return requests


def scale_arrivals(requests: list[SimRequest], factor: float) -> list[SimRequest]:
    """Multiply every open-loop arrival time by `factor` (< 1 compresses: more load)."""
    if not factor > 0:
        raise ValueError(f"arrival scale factor must be > 0, got {factor}")
    return [replace(request, arrival_s=request.arrival_s * factor) for request in requests]
