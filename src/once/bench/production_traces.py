"""Loaders for the production request traces in `../shared/data` (see its README).

- Mooncake (Kimi, FAST'25), JSONL: `{"timestamp": ms since start, "input_length": tokens,
  "output_length": tokens, "hash_ids": [int, ...]}`; `hash_ids` are chained prefix-block
  hashes of 512 tokens, `len(hash_ids) == ceil(input_length / 512)`.
- Azure LLM inference 2023 (Splitwise, ISCA'24), CSV: `TIMESTAMP, ContextTokens,
  GeneratedTokens`; wall-clock timestamps with 7 fractional digits; no prefixes.

Both load to `TraceRequest`s sorted by arrival, arrival in seconds from the first request
(Azure) or from the trace's zero (Mooncake). A malformed line raises `TraceFormatError`
naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypeGuard

MOONCAKE_BLOCK_SIZE = 512
MOONCAKE_TRACES = {
    "conversation": "conversation_trace_first30min.jsonl",
    "synthetic": "synthetic_trace.jsonl",
}
AZURE_TRACES = {
    "code": "AzureLLMInferenceTrace_code.csv",
    "conv": "AzureLLMInferenceTrace_conv.csv",
}
AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_REPO_ROOT = Path(__file__).resolve().parents[3]


class TraceFormatError(ValueError):
    def __init__(self, path: Path, line: int, field: str, problem: str):
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")
        self.path, self.line, self.field = path, line, field


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # as recorded (0 is accepted; simulators may clamp to 1)
    block_hashes: tuple[int, ...] = ()  # Mooncake: chained 512-token prefix blocks
    line: int = 0  # where it came from, for messages and stable ids


def shared_data_dir() -> Path:
    shared = os.environ.get("ONCE_SHARED_DATA")
    return Path(shared) if shared else _REPO_ROOT.parent / "shared" / "data"


def trace_path(kind: str, name: str) -> Path:
    """The path of a named trace: kind "mooncake" (conversation|synthetic) or "azure"
    (code|conv)."""
    tables = {"mooncake": MOONCAKE_TRACES, "azure": AZURE_TRACES}
    folders = {"mooncake": "mooncake", "azure": "azure_llm_2023"}
    if kind not in tables or name not in tables[kind]:
        known = {k: sorted(v) for k, v in tables.items()}
        raise ValueError(f"unknown trace {kind}/{name}; known: {known}")
    return shared_data_dir() / folders[kind] / tables[kind][name]


def load_mooncake(
    path: str | Path, *, minutes: float | None = None, limit: int | None = None
) -> list[TraceRequest]:
    path = Path(path)
    requests: list[TraceRequest] = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise TraceFormatError(path, number, "(line)", f"not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise TraceFormatError(path, number, "(line)", "not a JSON object")
            arrival_ms = _number(row, "timestamp", path, number)
            num_prompt = _count(row, "input_length", path, number, minimum=1)
            num_output = _count(row, "output_length", path, number, minimum=0)
            hashes = row.get("hash_ids")
            if not isinstance(hashes, list) or not all(_is_int(h) for h in hashes):
                raise TraceFormatError(path, number, "hash_ids", "must be a list of integers")
            expected = -(-num_prompt // MOONCAKE_BLOCK_SIZE)
            if len(hashes) != expected:
                raise TraceFormatError(
                    path,
                    number,
                    "hash_ids",
                    f"{len(hashes)} ids for {num_prompt} tokens (expected {expected})",
                )
            arrival_s = arrival_ms / 1000
            if minutes is not None and arrival_s >= minutes * 60:
                continue
            requests.append(TraceRequest(arrival_s, num_prompt, num_output, tuple(hashes), number))
            if limit is not None and len(requests) >= limit:
                break
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def load_azure(
    path: str | Path, *, minutes: float | None = None, limit: int | None = None
) -> list[TraceRequest]:
    path = Path(path)
    requests: list[TraceRequest] = []
    first: datetime | None = None
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        missing = [f for f in AZURE_FIELDS if f not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(path, 1, missing[0], f"missing from the header {AZURE_FIELDS}")
        for row in reader:
            number = reader.line_num
            stamp = row["TIMESTAMP"]
            try:
                # Python parses at most 6 fractional digits; the trace has 7 (100 ns).
                when = datetime.fromisoformat(_trim_fraction(stamp or ""))
            except ValueError:
                raise TraceFormatError(
                    path, number, "TIMESTAMP", f"not a date and time: {stamp!r}"
                ) from None
            num_prompt = _count(row, "ContextTokens", path, number, minimum=1, text=True)
            num_output = _count(row, "GeneratedTokens", path, number, minimum=0, text=True)
            first = first or when
            arrival_s = (when - first).total_seconds()
            if arrival_s < 0:
                raise TraceFormatError(path, number, "TIMESTAMP", "earlier than the first row")
            if minutes is not None and arrival_s >= minutes * 60:
                continue
            requests.append(TraceRequest(arrival_s, num_prompt, num_output, (), number))
            if limit is not None and len(requests) >= limit:
                break
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def _trim_fraction(stamp: str) -> str:
    head, dot, fraction = stamp.partition(".")
    return f"{head}.{fraction[:6]}" if dot else head


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(row: dict, field: str, path: Path, line: int) -> float:
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise TraceFormatError(path, line, field, f"must be a number >= 0, got {value!r}")
    return float(value)


def _count(row: dict, field: str, path: Path, line: int, *, minimum: int, text=False) -> int:
    value = row.get(field)
    if text and isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value < minimum:
        raise TraceFormatError(path, line, field, f"must be an integer >= {minimum}, got {value!r}")
    return value
