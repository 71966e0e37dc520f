"""The cache doctor's bar: every prefix break explained, with the right cause and place.

Two checks, each counting the breaks the doctor does not explain:

- real breaks, in recorded sessions whose prefixes really break. Each session is fed to
  a `CacheDoctor` call by call as Responses requests (`payloads.session_requests`), and
  the breaks it reports are compared with the ones read off the data independently:
  CodeR (all calls of a session as one stream): a break wherever `Call.agent` changes,
  cause `role_switch`, at the first chat message that differs between the two roles;
  SWE-agent-LM-32B: a break wherever an older observation has just been replaced by
  "Old environment output: (N lines omitted)", cause `history_edited`, at that item.
  A real break not reported with that cause and item, or a reported break with no real
  one, is unexplained.
- injected breaks, on a mini-swe-agent session (append-only, so its clean stream has no
  breaks) given a tool list and an approval-policy line in its instructions: at a few
  calls, one mutation each (tool order, a timestamp in the instructions, an edited
  earlier item, dropped earlier items, a changed policy text, another model, the previous
  output dropped, a changed tool, another task's first request). The doctor must report
  exactly that one break, with the expected cause, item and byte offset; the expected
  offset is where the canonical serializations of the clean and the mutated request first
  differ.

It also sets the doctor's expected cache hit (the reusable prefix) beside the cached
tokens Gemini really reported in the mini-swe-agent sessions.
"""

import copy
import json
from collections.abc import Callable
from pathlib import Path

from once.agent import doctor as causes
from once.agent.doctor import CacheDoctor
from once.agent.prefix import canonical_tools, common_prefix_len, serialize_request
from once.bench.payloads import SWEAGENT_1_1_TOOLS, session_requests
from once.bench.traces import CODER, MINI_SWE_AGENT, SWEAGENT_1_0, Session, load_sessions

ELISION_PREFIX = "Old environment output:"
POLICY_LINE = "\n\nApproval policy: on-request. Sandbox: workspace-write."
OTHER_TASK = "Please solve this issue: the admin page crashes when a filter contains a comma."
# (cause, item) per call index
Expected = dict[int, tuple[str, str]]


def run(root: str | Path | None = None, *, max_sessions: int | None = None) -> dict:
    """`cache_doctor_unexplained_breaks` (bar: 0) with counts per kind."""
    coder = [real_breaks(s, coder_breaks(s)) for s in _sessions(root, CODER, max_sessions)]
    lm32b = [real_breaks(s, elision_breaks(s)) for s in _sessions(root, SWEAGENT_1_0, max_sessions)]
    minis = _sessions(root, MINI_SWE_AGENT, None)
    injected = injected_breaks(next(s for s in minis if len(s.calls) >= 8)) if minis else {}
    real = {"coder": _total(coder), "sweagent_lm_32b": _total(lm32b)}
    limited = minis[:max_sessions] if max_sessions is not None else minis
    unexplained_injected = sum(kind["failed"] for kind in injected.values())
    unexplained_real = sum(counts["unexplained"] for counts in real.values())
    return {
        "cache_doctor_unexplained_breaks": unexplained_real + unexplained_injected,
        "real": real,
        "injected": injected,
        "injected_cases": sum(kind["cases"] for kind in injected.values()),
        "injected_failed": unexplained_injected,
        "gemini_cache_hits": cache_hits(limited),
    }


def cache_hits(sessions: list[Session]) -> dict:
    """Expected (reusable prefix bytes) vs actual (cached tokens) hit, over recorded usage."""
    expected: list[float] = []
    actual: list[float] = []
    num_misses = 0
    for session in sessions:
        doctor = CacheDoctor()
        for call, (request, output) in zip(session.calls, session_requests(session), strict=True):
            doctor.observe(request)
            doctor.record_output(output)
            if call.usage:
                doctor.record_usage(call.usage)
        for c in doctor.calls:
            if c.actual_hit is not None:
                expected.append(c.expected_hit)
                actual.append(c.actual_hit)
        num_misses += len(doctor.unexplained_misses())
    return {
        "sessions": len(sessions),
        "calls_with_usage": len(actual),
        "expected_hit": sum(expected) / len(expected) if expected else None,
        "actual_hit": sum(actual) / len(actual) if actual else None,
        "unexplained_misses": num_misses,
    }


def coder_breaks(session: Session) -> Expected:
    # Each role speaks in its own chat: when the role changes, the request is another chat.
    expected = {}
    for previous, call in zip(session.calls, session.calls[1:], strict=False):
        if call.agent != previous.agent:
            first = _first_differing_message(previous.messages + (previous.output,), call.messages)
            expected[call.index] = (causes.ROLE_SWITCH, _item_of_message(call.messages, first))
    return expected


def elision_breaks(session: Session) -> Expected:
    # SWE-agent keeps the last 5 observations: each call replaces the oldest kept one with
    # a one-line marker, in place.
    expected = {}
    for previous, call in zip(session.calls, session.calls[1:], strict=False):
        before = previous.messages + (previous.output,)
        for m, message in enumerate(call.messages):
            newly = m < len(before) and not before[m]["content"].startswith(ELISION_PREFIX)
            if newly and message["content"].startswith(ELISION_PREFIX):
                item = _item_of_message(call.messages, m)
                expected[call.index] = (causes.HISTORY_EDITED, item)
                break
    return expected


def real_breaks(session: Session, expected: Expected) -> dict:
    doctor = CacheDoctor()
    reported: Expected = {}
    for request, output in session_requests(session):
        brk = doctor.observe(request)
        doctor.record_output(output)
        if brk is not None:
            reported[brk.call_index] = (brk.cause, brk.item)
    missed = sum(1 for call in expected if call not in reported)
    wrong = sum(1 for call in expected if call in reported and reported[call] != expected[call])
    spurious = sum(1 for call in reported if call not in expected)
    return {
        "sessions": 1,
        "calls": len(session.calls),
        "real_breaks": len(expected),
        "reported_breaks": len(reported),
        "missed": missed,
        "wrong_cause_or_item": wrong,
        "spurious": spurious,
        "unexplained": missed + wrong + spurious,
    }


def injected_breaks(session: Session) -> dict[str, dict]:
    """Per kind of injected break: cases tried, cases failed, and the first failure."""
    requests = session_requests(session)
    tools = canonical_tools(SWEAGENT_1_1_TOOLS)
    for request, _ in requests:
        request["tools"] = tools
        request["instructions"] = request.get("instructions", "") + POLICY_LINE
    outputs = [output for _, output in requests]
    results: dict[str, dict] = {}
    positions = sorted({2, len(requests) // 2, len(requests) - 1})
    for kind, (mutate, cause) in _injections().items():
        results[kind] = {"cases": 0, "failed": 0, "first_failure": None}
        for k in positions:
            clean = requests[k][0]
            previous_input = len(requests[k - 1][0]["input"])
            mutated, item = mutate(copy.deepcopy(clean), previous_input, len(outputs[k - 1]))
            offset = common_prefix_len(
                serialize_request(clean).encode(), serialize_request(mutated).encode()
            )
            want = {k: (cause, item, offset)}
            got = _feed([request for request, _ in requests[:k]] + [mutated], outputs)
            results[kind]["cases"] += 1
            if got != want:
                results[kind]["failed"] += 1
                if results[kind]["first_failure"] is None:
                    results[kind]["first_failure"] = {
                        "expected": _listed(want),
                        "got": _listed(got),
                    }
    return results


def _injections() -> dict[str, tuple[Callable, str]]:
    # Each takes (request, len(previous input), len(previous output)) and returns the
    # mutated request and the item the doctor should name.
    def swap_tools(request, _n, _m):
        request["tools"][0], request["tools"][1] = request["tools"][1], request["tools"][0]
        return request, "tools[0]"

    def timestamp(request, _n, _m):
        head, rest = request["instructions"].split("\n", 1)
        request["instructions"] = f"{head} Current time: 2026-11-05T10:42:17Z.\n{rest}"
        return request, "instructions"

    def edit_earlier(request, n, _m):
        j = n // 2
        item = request["input"][j]
        # An assistant item carries its text in content parts, a user item as a string.
        holder, key = (
            (item["content"][0], "text") if item["role"] == "assistant" else (item, "content")
        )
        middle = len(holder[key]) // 2
        holder[key] = holder[key][:middle] + " (edited)" + holder[key][middle:]
        return request, f"input[{j}]"

    def drop_earlier(request, n, _m):
        j = max(1, n // 2 - 1)
        del request["input"][j : j + 2]
        return request, f"input[{j}]"

    def policy(request, _n, _m):
        request["instructions"] = request["instructions"].replace("on-request", "never")
        return request, "instructions"

    def model(request, _n, _m):
        request["model"] = request["model"] + "-v2"
        return request, "model"

    def drop_output(request, n, m):
        del request["input"][n : n + m]
        return request, f"input[{n}]"

    def other_conversation(request, _n, _m):
        # Another task's first request on the same harness: same instructions and tools.
        request["input"] = [{"type": "message", "role": "user", "content": OTHER_TASK}]
        return request, "input[0]"

    def tool_content(request, _n, _m):
        request["tools"][-1] = {**request["tools"][-1], "description": "submits the patch"}
        return request, f"tools[{len(request['tools']) - 1}]"

    return {
        "tool_order": (swap_tools, causes.TOOLS_CHANGED),
        "tool_content": (tool_content, causes.TOOLS_CHANGED),
        "timestamp_in_instructions": (timestamp, causes.INSTRUCTIONS_CHANGED),
        "policy_text": (policy, causes.INSTRUCTIONS_CHANGED),
        "edited_earlier_item": (edit_earlier, causes.HISTORY_EDITED),
        "dropped_earlier_items": (drop_earlier, causes.HISTORY_TRUNCATED),
        "model": (model, causes.MODEL_OR_PARAMS_CHANGED),
        "dropped_previous_output": (drop_output, causes.OUTPUT_NOT_APPENDED),
        "other_conversation": (other_conversation, causes.ROLE_SWITCH),
    }


def _feed(requests: list[dict], outputs: list[list[dict]]) -> dict[int, tuple[str, str, int]]:
    doctor = CacheDoctor()
    for request, output in zip(requests, outputs, strict=False):
        doctor.observe(request)
        doctor.record_output(output)
    return {b.call_index: (b.cause, b.item, b.byte_offset) for b in doctor.breaks}


def _first_differing_message(before: tuple[dict, ...], after: tuple[dict, ...]) -> int:
    for m, (old, new) in enumerate(zip(before, after, strict=False)):
        if old != new:
            return m
    return min(len(before), len(after))


def _item_of_message(messages: tuple[dict, ...], m: int) -> str:
    # A leading system message is the request's instructions; the rest are input items.
    if messages and messages[0]["role"] == "system":
        return "instructions" if m == 0 else f"input[{m - 1}]"
    return f"input[{m}]"


def _sessions(root, source: str, limit: int | None) -> list[Session]:
    try:
        sessions = load_sessions(root, source=source)
    except FileNotFoundError:
        return []
    return sessions[:limit] if limit is not None else sessions


def _total(per_session: list[dict]) -> dict:
    keys: tuple[str, ...] = ("sessions", "calls", "real_breaks", "reported_breaks", "missed")
    keys += ("wrong_cause_or_item", "spurious", "unexplained")
    return {key: sum(counts[key] for counts in per_session) for key in keys}


def _listed(breaks: dict) -> list:
    return [[call, *found] for call, found in sorted(breaks.items())]


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
