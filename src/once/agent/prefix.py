"""The stable prefix: one canonical serialization for every request the harness sends.

A provider's prefix cache (and once's WebSocket chain) reuses work only while the bytes
at the head of the prompt repeat exactly. Three things break that silently, and this
module closes each:

- tool order: tools come out of MCP servers and dicts in registration order, which
  differs between runs; `canonical_tools` sorts them by (namespace, name) and rebuilds
  every JSON object with its keys sorted, so even a plain `json.dumps` is stable;
- key order and whitespace: `serialize_request` is the one serializer (sorted keys,
  fixed separators, UTF-8 kept as is), shared with the cache doctor's fingerprints;
- per-run values in the instructions: `check_instructions` refuses text that carries a
  timestamp, a date, a UUID, a response or call id, or another value that changes from
  run to run. Such values belong in the tail (a user message), never in the head.

`Fingerprint` cuts a request into parts in prompt order (params, instructions, each tool,
each input item), each with a digest of its canonical text, chained so that one digest
names a whole prefix. The functions after it compare two fingerprints: where they first
differ, at which byte of the canonical text, how much prompt they share. The cache
doctor (`doctor.py`) builds its diagnosis on them.
"""

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, AnyStr, NamedTuple

from once.agent.tools.base import NAMESPACE_SEPARATOR, ToolSpec
from once.protocol.responses import canonical_json

# What counts as a per-run value in instructions. Each pattern names one kind, so the
# error (and the cache doctor's report) says what it found. Deliberately broad: a false
# refusal costs a rewrite of the prompt, a missed one costs a cache miss on every call.
VOLATILE_PATTERNS: dict[str, re.Pattern[str]] = {
    # 2026-11-05, 2026-11-05T10:42:17Z, 2026/11/05 10:42
    "iso_date": re.compile(r"\b\d{4}[-/]\d{2}[-/]\d{2}(?:\b|(?=T\d))"),
    # 11/05/2026, 5.11.2026
    "numeric_date": re.compile(r"\b\d{1,2}[/.]\d{1,2}[/.]\d{4}\b"),
    # Nov 5, 2026 / 5 November 2026 / November 2026
    "written_date": re.compile(
        r"\b(?:January|February|March|April|May|June|July|August|September|October|November"
        r"|December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)\.?"
        r"(?:\s+\d{1,2}(?:st|nd|rd|th)?,?)?\s+(?:19|20)\d{2}\b"
    ),
    # 10:42:17, 10:42 pm, 10:42 UTC
    "time_of_day": re.compile(
        r"\b\d{1,2}:\d{2}:\d{2}\b|\b\d{1,2}:\d{2}\s*(?:[AaPp]\.?[Mm]\b|UTC\b|GMT\b|Z\b)"
    ),
    # "today is", "the current date", "current time": the sentence exists to vary
    "current_date_phrase": re.compile(
        r"\b(?:today is|today's date|current (?:date|time|timestamp)|the time is)\b",
        re.IGNORECASE,
    ),
    # Unix time in seconds or milliseconds, 2017..2033
    "unix_time": re.compile(r"\b1[5-9]\d{8}(?:\d{3})?\b"),
    "uuid": re.compile(
        r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    ),
    # resp_…, msg_…, call_…, fc_…, toolu_…, chatcmpl-…: an id body has a digit, so
    # words such as "call_function" do not match.
    "api_id": re.compile(
        r"\b(?:resp|msg|fc|call|rs|ws|conv|req|run|sess|toolu|chatcmpl|item|thread|asst)"
        r"[_-](?=[A-Za-z0-9]*\d)[A-Za-z0-9]{8,}\b"
    ),
    # 32+ hex digits: request ids, tokens, content hashes (a commit SHA is per task at best)
    "hex_token": re.compile(r"\b[0-9a-fA-F]{32,}\b"),
    # tempfile.mkdtemp() names
    "temp_path": re.compile(r"/tmp/tmp[A-Za-z0-9_]{6,}"),
    "process_id": re.compile(r"\b(?:pid|PID|process id)[\s:=#]+\d+\b"),
}


def find_volatile(text: str) -> list[tuple[str, str, int]]:
    """Every per-run value in `text` as (kind, matched text, character offset), in order."""
    found = [
        (kind, match.group(), match.start())
        for kind, pattern in VOLATILE_PATTERNS.items()
        for match in pattern.finditer(text)
    ]
    return sorted(found, key=lambda hit: (hit[2], hit[0]))


def check_instructions(text: str) -> str:
    """`text` unchanged, or ValueError naming the first per-run value in it."""
    if not isinstance(text, str):
        raise ValueError(f"instructions must be a str, not {type(text).__name__}")
    hits = find_volatile(text)
    if hits:
        kind, value, offset = hits[0]
        raise ValueError(
            f"instructions contain a per-run value ({kind} {value!r} at character {offset}); "
            "it would change the prompt head on every run: move it to a user message"
        )
    return text


def canonical_tools(tools: Iterable[ToolSpec | dict]) -> list[dict]:
    """Function tools sorted by (namespace, name), each with its JSON keys sorted.

    Takes `ToolSpec`s or Responses tool dicts (a namespaced dict tool is recognized by
    its "<namespace>__<name>" function name). The dicts returned are fresh copies, so a
    later edit of a spec cannot reach a request already built.
    """
    keyed: dict[str | None, tuple[tuple[str, str], dict]] = {}
    for tool in tools:
        if isinstance(tool, ToolSpec):
            sort_key, body = (tool.namespace, tool.name), tool.to_function_tool()
        elif isinstance(tool, dict):
            sort_key, body = _dict_tool_key(tool), tool
        else:
            raise ValueError(f"a tool must be a ToolSpec or a dict, not {type(tool).__name__}")
        name = body.get("name") or body.get("type")
        if name in keyed:
            raise ValueError(f"tool {name!r} is given twice")
        keyed[name] = (sort_key, _with_sorted_keys(body))
    return [body for _, body in sorted(keyed.values(), key=lambda entry: entry[0])]


def serialize_request(body: dict) -> str:
    """The canonical text of a request: sorted keys, no spaces, non-ASCII kept."""
    if not isinstance(body, dict):
        raise ValueError(f"a request body is a dict, not {type(body).__name__}")
    return canonical_json(body)


def build_request(
    *,
    model: str,
    instructions: str | None,
    tools: Iterable[ToolSpec | dict],
    input_items: list[dict],
    **params: Any,
) -> dict:
    """A full Responses request whose head (instructions, tools) is byte-stable."""
    request: dict[str, Any] = {"model": model, "input": list(input_items), **params}
    if instructions is not None:
        request["instructions"] = check_instructions(instructions)
    canonical = canonical_tools(tools)
    if canonical:
        request["tools"] = canonical
    return request


_MISSING = object()


class Part(NamedTuple):
    name: str  # "params", "instructions", "tools[i]", "input[i]"
    text: str  # canonical JSON of the part's value ("null" when absent)
    digest: bytes
    num_bytes: int


def _part(name: str, value: Any) -> Part:
    text = canonical_json(value)
    data = text.encode()
    return Part(name, text, hashlib.blake2b(data, digest_size=16).digest(), len(data))


@dataclass(frozen=True)
class Fingerprint:
    """A request cut into digested parts; `output` is added once its response is known."""

    parts: tuple[Part, ...]
    num_input: int
    output: tuple[Part, ...] = ()

    @property
    def continued(self) -> tuple[Part, ...]:
        """What the next request should start with: these parts, then the output items."""
        return self.parts + self.output

    @property
    def prompt_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts if p.name != "params" and p.text != "null")

    def with_output(self, items: list[dict]) -> "Fingerprint":
        first = self.num_input
        output = tuple(_part(f"input[{first + j}]", item) for j, item in enumerate(items))
        return Fingerprint(self.parts, self.num_input, output)

    def chain(self) -> list[bytes]:
        """chain[k] digests parts[0..k]: equal chains at k mean equal prefixes up to k."""
        chain, link = [], b""
        for part in self.parts:
            link = hashlib.blake2b(link + part.digest, digest_size=16).digest()
            chain.append(link)
        return chain

    @property
    def digest(self) -> str:
        return self.chain()[-1].hex()

    def conversation_root(self) -> bytes | None:
        """The chain up to the first input item: it names the conversation."""
        first = next((k for k, p in enumerate(self.parts) if p.name == "input[0]"), None)
        return None if first is None else self.chain()[first]

    def section(self, name: str) -> tuple[Part, ...]:
        """The parts of "tools" or "input" (with the output items), in order."""
        return tuple(p for p in self.continued if p.name.startswith(name + "["))


def fingerprint(body: dict) -> Fingerprint:
    """Parts in prompt order: params (every other field, one part), instructions, tools, input."""
    items = body.get("input")
    if not isinstance(items, list):
        raise ValueError("a fingerprinted request needs its input as a list of items")
    params = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools")}
    parts = [_part("params", params), _part("instructions", body.get("instructions"))]
    parts += [_part(f"tools[{i}]", tool) for i, tool in enumerate(body.get("tools") or ())]
    parts += [_part(f"input[{i}]", item) for i, item in enumerate(items)]
    return Fingerprint(tuple(parts), len(items))


def common_prefix_len(a: AnyStr, b: AnyStr) -> int:
    """How many leading characters (of str) or bytes (of bytes) a and b share.

    Binary search for the first mismatch: a[:lo] == b[:lo] is known and the answer is at
    most hi. Each probe compares only the window still in doubt, so the slices copied add
    up to about 2 * len rather than len * log(len), and the compares run at memcmp speed.
    """
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def first_difference(expected: tuple[Part, ...], new: tuple[Part, ...]) -> int | None:
    """The first part whose name or digest differs; None when `new` only appends items.

    A tool added after the last expected tool is a change, not an extension.
    """
    for k, (old, part) in enumerate(zip(expected, new, strict=False)):
        if old.name != part.name or old.digest != part.digest:
            return k
    k = min(len(expected), len(new))
    if k == len(new) == len(expected) or (k < len(new) and new[k].name.startswith("input[")):
        return None
    return k


def differing_part(old: Part | None, new: Part | None) -> str:
    """The name to report at a first difference (either side may have run out of parts)."""
    # Names differ only when a tool was added or removed: tools come before input items.
    if old is None or new is None:
        remaining = old or new
        if remaining is None:
            raise ValueError("no first difference: both sides ran out of parts")
        return remaining.name
    return new.name if new.name.startswith("tools[") else old.name


def part_index(name: str) -> int:
    return int(name[name.index("[") + 1 : -1])


def byte_offset(body: dict, name: str, expected: tuple[Part, ...]) -> int:
    """Where `body` leaves the `expected` parts at part `name`, in bytes of its canonical text.

    The expected value goes back at `name` alone; the first byte where the canonical texts
    of that hybrid and of `body` differ is the answer, whatever the key order puts first.
    """
    if "[" not in name and name != "instructions":  # a param
        value = json.loads(expected[0].text).get(name, _MISSING)
    else:
        part = next((p for p in expected if p.name == name), None)
        value = _MISSING if part is None or part.text == "null" else json.loads(part.text)
    hybrid = dict(body)
    if "[" in name:
        key, i = name[: name.index("[")], part_index(name)
        values = list(hybrid.get(key) or ())
        if value is _MISSING:
            del values[i]
        elif i < len(values):
            values[i] = value
        else:
            values.append(value)
        hybrid[key] = values
    elif value is _MISSING:
        hybrid.pop(name, None)
    else:
        hybrid[name] = value
    return common_prefix_len(serialize_request(hybrid).encode(), serialize_request(body).encode())


def shared_prompt_bytes(reference: tuple[Part, ...], new: tuple[Part, ...]) -> int:
    """Prompt bytes of `new` that repeat `reference` from its start: what a cache reuses."""
    # Params are not prompt bytes, but another model or other params share nothing.
    shared = 0
    for old, part in zip(reference, new, strict=False):
        if old.name != part.name:
            break
        if old.digest != part.digest:
            if part.name == "params":
                return 0
            return shared + common_prefix_len(old.text.encode(), part.text.encode())
        if part.name != "params" and part.text != "null":
            shared += part.num_bytes
    return shared


def realign(old: tuple[Part, ...], new: tuple[Part, ...], i: int) -> tuple[int, int] | None:
    """(m, j): the first new[m] (m >= i) equal to some old[j] (j >= i), where two histories
    meet again after differing at i; j > m means items were dropped."""
    first_at: dict[bytes, int] = {}
    for j in range(len(old) - 1, i - 1, -1):
        first_at[old[j].digest] = j
    for m in range(i, len(new)):
        if new[m].digest in first_at:
            return m, first_at[new[m].digest]
    return None


def _dict_tool_key(tool: dict) -> tuple[str, str]:
    name = tool.get("name")
    if not isinstance(name, str):  # a hosted tool ({"type": "web_search"}) has no name
        return "", str(tool.get("type", ""))
    namespace, separator, bare = name.partition(NAMESPACE_SEPARATOR)
    return (namespace, bare) if separator else ("", name)


def _with_sorted_keys(value: Any) -> Any:
    # A round trip through sorted JSON copies the value and fixes every object's key order.
    return json.loads(canonical_json(value))
