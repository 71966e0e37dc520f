"""The cache doctor: which byte of which request broke the prompt prefix, and why.

Each request is fingerprinted (`prefix.fingerprint`: a digest per part, in prompt order).
A request continues the previous one when its parts are the previous request's parts
plus the previous output items, then anything new. Otherwise the doctor reports a Break:

    expected  params | instructions | tools[0..] | input[0..n-1] | output[0..m-1]
    new       params | instructions | tools[0..] | input[0..n+m-1]       | new items...
                                                              ^ the first part whose
                                                                digest differs

naming that part, the byte offset in `serialize_request(new)` where the new request
leaves the expected one (the first byte that differs from the same request with only that
part put back as expected), and a cause from a fixed vocabulary (`CAUSES`). A different
conversation (`role_switch`: the first input item differs, and so do the instructions or
all of the old history) is checked first; otherwise the part's section decides: params ->
`model_or_params_changed`, instructions -> `instructions_changed`, tools ->
`tools_changed`, an item of the previous input -> `history_truncated` (items dropped) or
`history_edited`, an item where the previous output belongs -> `output_not_appended`.

Per call it also keeps the prompt bytes a prefix cache could reuse (against the previous
request, or the last request of the same conversation when an agent returns to one) next
to the `cached_tokens` the server reported.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from once.agent.prefix import (
    Fingerprint,
    Part,
    byte_offset,
    common_prefix_len,
    differing_part,
    find_volatile,
    fingerprint,
    first_difference,
    part_index,
    realign,
    shared_prompt_bytes,
)

TOOLS_CHANGED = "tools_changed"
INSTRUCTIONS_CHANGED = "instructions_changed"
MODEL_OR_PARAMS_CHANGED = "model_or_params_changed"
HISTORY_EDITED = "history_edited"
HISTORY_TRUNCATED = "history_truncated"
OUTPUT_NOT_APPENDED = "output_not_appended"
ROLE_SWITCH = "role_switch"
CAUSES = (
    TOOLS_CHANGED,
    INSTRUCTIONS_CHANGED,
    MODEL_OR_PARAMS_CHANGED,
    HISTORY_EDITED,
    HISTORY_TRUNCATED,
    OUTPUT_NOT_APPENDED,
    ROLE_SWITCH,
)

# A call whose reusable prefix promised more cached tokens than this gap above what the
# server reported is listed as a miss the prefix does not explain.
UNEXPLAINED_MISS_GAP = 0.25
# Markers harnesses put where they cut an old output (SWE-agent: "(N lines omitted)").
_ELISION = re.compile(r"omitted|elided|truncated|\[\.\.\.\]|removed to save", re.IGNORECASE)
_ABSENT = object()


@dataclass(frozen=True)
class Break:
    call_index: int
    cause: str  # one of CAUSES
    item: str  # "model" (or another param), "instructions", "tools[i]", "input[i]"
    byte_offset: int  # into serialize_request(request).encode() of the breaking request
    detail: str


@dataclass
class CallRecord:
    index: int
    fingerprint: str  # hex digest of the request's whole hash chain
    prompt_bytes: int  # instructions + tools + input, canonically serialized
    expected_cached_bytes: int  # of those, the prefix a cache already holds
    brk: Break | None = None
    input_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def expected_hit(self) -> float:
        return self.expected_cached_bytes / self.prompt_bytes if self.prompt_bytes else 0.0

    @property
    def actual_hit(self) -> float | None:
        if self.cached_tokens is None or not self.input_tokens:
            return None
        return self.cached_tokens / self.input_tokens


class CacheDoctor:
    """Feed it every full request in order: observe, then record_output and record_usage."""

    def __init__(self, *, max_conversations: int = 16):
        self.calls: list[CallRecord] = []
        self.breaks: list[Break] = []
        self._previous: Fingerprint | None = None
        # conversation root -> (its last call, fingerprint): an agent that returns to a
        # conversation (a CodeR role) may still find that prefix in the server's cache.
        self._conversations: dict[bytes, tuple[int, Fingerprint]] = {}
        self._max_conversations = max_conversations

    def observe(self, request: dict) -> Break | None:
        """Fingerprint the next full request (before it is sent); its break, if any."""
        body = _normalized(request)
        new = fingerprint(body)
        index = len(self.calls)
        brk = None if self._previous is None else self._diagnose(index, self._previous, new, body)
        root = new.conversation_root()
        references = [] if self._previous is None else [self._previous]
        if root in self._conversations:
            references.append(self._conversations[root][1])
        reusable = max((shared_prompt_bytes(r.continued, new.parts) for r in references), default=0)
        self.calls.append(CallRecord(index, new.digest, new.prompt_bytes, reusable, brk))
        if brk is not None:
            self.breaks.append(brk)
        self._previous = new
        self._remember(root, index, new)
        return brk

    def record_output(self, items: list[dict]) -> None:
        """The last call's output items, exactly as the harness will append them."""
        if self._previous is None:
            raise ValueError("record_output before any observed request")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ValueError("output items must be a list of dicts")
        self._previous = self._previous.with_output(items)
        self._remember(self._previous.conversation_root(), len(self.calls) - 1, self._previous)

    def record_usage(self, usage: dict) -> None:
        """The last call's token usage (Responses or Chat Completions shape)."""
        if not self.calls:
            raise ValueError("record_usage before any observed request")
        if not isinstance(usage, dict):
            raise ValueError(f"usage must be a dict, not {type(usage).__name__}")
        prefix = "input" if "input_tokens" in usage else "prompt"
        input_tokens = usage.get(f"{prefix}_tokens")
        cached = (usage.get(f"{prefix}_tokens_details") or {}).get("cached_tokens", 0)
        if not isinstance(input_tokens, int) or not isinstance(cached, int):
            raise ValueError(f"usage has no integer input and cached token counts: {usage}")
        self.calls[-1].input_tokens, self.calls[-1].cached_tokens = input_tokens, cached

    def unexplained_misses(self) -> list[CallRecord]:
        return [
            c
            for c in self.calls
            if c.actual_hit is not None and c.actual_hit < c.expected_hit - UNEXPLAINED_MISS_GAP
        ]

    def summary(self) -> dict:
        by_cause: dict[str, int] = {}
        for brk in self.breaks:
            by_cause[brk.cause] = by_cause.get(brk.cause, 0) + 1
        measured = [c.actual_hit for c in self.calls if c.actual_hit is not None]
        return {
            "calls": len(self.calls),
            "breaks": len(self.breaks),
            "breaks_by_cause": by_cause,
            "expected_hit": _mean([c.expected_hit for c in self.calls]),
            "actual_hit": _mean(measured) if measured else None,
            "unexplained_misses": [c.index for c in self.unexplained_misses()],
        }

    def report(self) -> str:
        summary = self.summary()
        causes = ", ".join(f"{k} {v}" for k, v in sorted(summary["breaks_by_cause"].items()))
        head = f"cache doctor: {summary['calls']} calls, {summary['breaks']} prefix breaks"
        lines = [head + (f" ({causes})" if causes else "")]
        lines += [
            f"  call {b.call_index}: {b.cause} at {b.item}, byte {b.byte_offset}: {b.detail}"
            for b in self.breaks
        ]
        line = f"  reusable prefix: {summary['expected_hit']:.1%} of prompt bytes"
        if summary["actual_hit"] is not None:
            line += f"; cached: {summary['actual_hit']:.1%} of input tokens"
        lines.append(line)
        lines += [
            f"  call {c.index}: expected {c.expected_hit:.0%} cached, got {c.actual_hit:.0%} "
            f"({c.cached_tokens}/{c.input_tokens} tokens): not a prefix change (eviction, "
            "another replica, or a prompt shorter than one cache block)"
            for c in self.unexplained_misses()
        ]
        return "\n".join(lines)

    def _remember(self, root: bytes | None, index: int, snapshot: Fingerprint) -> None:
        if root is None:
            return
        self._conversations.pop(root, None)  # re-insert: the dict's order is recency
        self._conversations[root] = (index, snapshot)
        while len(self._conversations) > self._max_conversations:
            self._conversations.pop(next(iter(self._conversations)))

    def _diagnose(self, index: int, previous: Fingerprint, new: Fingerprint, body: dict):
        expected = previous.continued
        k = first_difference(expected, new.parts)
        if k is None:
            return None
        old_part = expected[k] if k < len(expected) else None
        new_part = new.parts[k] if k < len(new.parts) else None
        name = differing_part(old_part, new_part)
        old_items, new_items = previous.section("input"), new.section("input")
        # Every fingerprint starts with params and instructions: both sides have them.
        if name == "params":
            assert old_part is not None and new_part is not None
            name, detail = _explain_params(json.loads(old_part.text), json.loads(new_part.text))
            cause = MODEL_OR_PARAMS_CHANGED
        elif name == "instructions":
            assert old_part is not None and new_part is not None
            cause = INSTRUCTIONS_CHANGED
            detail = _explain_instructions(json.loads(old_part.text), json.loads(new_part.text))
        elif name.startswith("tools["):
            cause = TOOLS_CHANGED
            detail = _explain_tools(previous.section("tools"), new.section("tools"), name)
        elif (i := part_index(name)) < previous.num_input:
            cause, detail = _explain_history(old_items, new_items, i, previous.num_input)
        else:
            cause = OUTPUT_NOT_APPENDED
            detail = _explain_output(old_items, new_items, i, previous.num_input)
        switch = self._conversation_switch(previous, new, old_items, new_items)
        if switch is not None:
            cause, detail = ROLE_SWITCH, switch
        offset = byte_offset(body, name, expected)
        return Break(index, cause, name, offset, detail)

    def _conversation_switch(self, previous, new, old_items, new_items) -> str | None:
        # A different conversation: the first input item differs, and so do the
        # instructions, or none of the old history is left (an edit or a compaction keeps
        # some). With one item on each side there is nothing else to compare: a first item
        # that is mostly unchanged is then an edit.
        if not old_items or not new_items or old_items[0].digest == new_items[0].digest:
            return None
        same_instructions = previous.parts[1].digest == new.parts[1].digest
        if same_instructions:
            if realign(old_items, new_items, 0) is not None:
                return None
            single = len(old_items) == 1 and len(new_items) == 1
            if single and _similarity(old_items[0].text, new_items[0].text) >= 0.5:
                return None
        what = "input[0]" if same_instructions else "instructions and input[0]"
        seen = self._conversations.get(new.conversation_root())
        where = f"back to the conversation of call {seen[0]}" if seen else "a new conversation"
        return f"a different conversation ({what} differ): {where}"


def _normalized(request: dict) -> dict:
    if not isinstance(request, dict):
        raise ValueError(f"a request is a dict, not {type(request).__name__}")
    if "previous_response_id" in request:
        raise ValueError("the doctor needs the full request, not an incremental one")
    raw_input = request.get("input")
    if isinstance(raw_input, str):  # offsets then refer to this one-item list form
        return {**request, "input": [{"type": "message", "role": "user", "content": raw_input}]}
    if not isinstance(raw_input, list) or not all(isinstance(i, dict) for i in raw_input):
        raise ValueError("a request's input must be a string or a list of item dicts")
    return request


def _similarity(a: str, b: str) -> float:
    # Shared head + shared tail over the longer text: near 1 for a local edit.
    a_bytes, b_bytes = a.encode(), b.encode()
    head = common_prefix_len(a_bytes, b_bytes)
    tail = common_prefix_len(a_bytes[::-1], b_bytes[::-1])
    return min(head + tail, len(a_bytes), len(b_bytes)) / max(len(a_bytes), len(b_bytes), 1)


def _explain_params(old: dict, new: dict) -> tuple[str, str]:
    fields = [f for f in sorted(set(old) | set(new)) if old.get(f, _ABSENT) != new.get(f, _ABSENT)]
    changes = [
        f"{f}: {_short(old.get(f, _ABSENT))} -> {_short(new.get(f, _ABSENT))}" for f in fields
    ]
    return fields[0], "; ".join(changes)


def _explain_instructions(old: str | None, new: str | None) -> str:
    if old is None or new is None:
        return "instructions added" if old is None else "instructions removed"
    at = common_prefix_len(old.encode(), new.encode())
    at = len(old.encode()[:at].decode(errors="ignore"))
    detail = f"from character {at}: {_excerpt(old, at)} -> {_excerpt(new, at)}"
    added = {(k, v) for k, v, _ in find_volatile(new)} - {(k, v) for k, v, _ in find_volatile(old)}
    if added:
        values = ", ".join(f"{k} {v!r}" for k, v in sorted(added))
        detail += f"; adds a per-run value ({values}): keep the instructions free of them"
    return detail


def _explain_tools(old: tuple[Part, ...], new: tuple[Part, ...], name: str) -> str:
    if sorted(p.digest for p in old) == sorted(p.digest for p in new):
        i = part_index(name)
        was, now = _tool_name(old[i]), _tool_name(new[i])
        return (
            f"order only: {name} is {now!r}, was {was!r} (the same {len(new)} tools; "
            "sort them with prefix.canonical_tools)"
        )
    old_by_name = {_tool_name(p): json.loads(p.text) for p in old}
    new_by_name = {_tool_name(p): json.loads(p.text) for p in new}
    notes = []
    for tool_name, tool in new_by_name.items():
        before = old_by_name.get(tool_name)
        if before is None:
            notes.append(f"added {tool_name!r}")
        elif before != tool:
            keys = sorted(k for k in set(before) | set(tool) if before.get(k) != tool.get(k))
            notes.append(f"content of {tool_name!r} changed ({', '.join(keys)})")
    notes += [f"removed {n!r}" for n in old_by_name if n not in new_by_name]
    return "; ".join(notes) or "order changed"


def _explain_history(old, new, i: int, num_input: int) -> tuple[str, str]:
    meet = realign(old, new, i)
    if i >= len(new):
        return HISTORY_TRUNCATED, f"the request ends at input[{i}]: the rest of the history is gone"
    if meet is None:
        cause = HISTORY_TRUNCATED if len(new) < num_input else HISTORY_EDITED
        return cause, f"from input[{i}] on, none of the previous history is left"
    m, j = meet
    if j > m:
        replaced = f", {m - i} new item(s) in their place" if m > i else ""
        return HISTORY_TRUNCATED, f"input[{i}..{j - 1}] ({j - i} items) dropped{replaced}"
    if j < m:
        return HISTORY_EDITED, f"{m - j} item(s) inserted at input[{i}]"
    edit = _describe_edit(json.loads(old[i].text), json.loads(new[i].text))
    run = f" (and the next {m - i - 1})" if m - i > 1 else ""
    return HISTORY_EDITED, f"input[{i}]{run} changed: {edit}"


def _describe_edit(old: dict, new: dict) -> str:
    kind, new_kind = _kind(old), _kind(new)
    if kind != new_kind:
        return f"{kind} replaced by {new_kind}"
    before, after = _item_text(old), _item_text(new)
    sizes = f"{len(before.encode())} -> {len(after.encode())} bytes"
    if _ELISION.search(after) and not _ELISION.search(before):
        return f"{kind} elided, replaced by {_short(after)} ({sizes})"
    if old.get("type") == "function_call_output":
        return f"tool output replaced ({sizes})"
    at = common_prefix_len(before.encode(), after.encode())
    at = len(before.encode()[:at].decode(errors="ignore"))
    return f"{kind} edited at character {at}: {_excerpt(before, at)} -> {_excerpt(after, at)}"


def _explain_output(old, new, i: int, num_input: int) -> str:
    j, expected = i - num_input, json.loads(old[i].text)
    where = f"output item {j} of the previous response ({_kind(expected)})"
    if i >= len(new):
        return f"the request ends where {where} belongs"
    found = json.loads(new[i].text)
    if _kind(found) != _kind(expected):
        return f"{where} is missing: a {_kind(found)} is in its place"
    dropped = sorted(set(expected) - set(found))
    if dropped:
        return f"{where} appended without {', '.join(dropped)}"
    return f"{where} appended changed: {_describe_edit(expected, found)}"


def _kind(item: dict) -> str:
    if item.get("type", "message") == "message":
        return f"{item.get('role', '?')} message"
    if item.get("type") == "function_call_output":
        return f"tool output of {item.get('call_id')}"
    return str(item.get("type"))


def _item_text(item: dict) -> str:
    for key in ("content", "output", "arguments"):
        if key in item:
            value = item[key]
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return json.dumps(item, sort_keys=True)


def _tool_name(part: Part) -> str:
    tool = json.loads(part.text)
    return str(tool.get("name") or tool.get("type"))


def _excerpt(text: str, at: int, width: int = 24) -> str:
    start = max(0, at - width)
    head = "…" if start else ""
    tail = "…" if at + width < len(text) else ""
    return repr(head + text[start : at + width] + tail)


def _short(value: Any, limit: int = 60) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "…"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
