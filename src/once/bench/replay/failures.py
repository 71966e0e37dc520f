"""A replay whose calls failed still reports: which call failed and why, and what was measured.

A session stops at its first failed call on a stack (traffic.py) and keeps the calls
before it. The ledger compares stacks call by call, so it is computed over the calls
every stack completed (`calls_compared`, per session; a session none of whose calls
every stack completed is left out), and the report adds

    failures        [{stack, session_id, call, error}], in the order they happened
    calls_compared  {session_id: calls in the ledger}
    calls           every call measured, on every stack (not only the compared ones)

When no call is left to compare, the report holds these fields alone (`failed_report`).
"""

from __future__ import annotations

from typing import TextIO


def collect(traffic: dict[str, dict]) -> list[dict]:
    return [failure for facts in traffic.values() for failure in facts.get("failures", [])]


def compared_calls(records: dict[str, dict[str, list[dict]]], session_ids) -> dict[str, int]:
    """Per session, the calls every stack completed (they run in order: a prefix)."""
    return {
        session_id: min(len(by_session.get(session_id, [])) for by_session in records.values())
        for session_id in session_ids
    }


def trim(
    records: dict[str, dict[str, list[dict]]], counts: dict[str, int]
) -> dict[str, dict[str, list[dict]]]:
    return {
        stack: {s: rows[: counts[s]] for s, rows in by_session.items() if counts.get(s)}
        for stack, by_session in records.items()
    }


def add_failures(report: dict, failures: list[dict], counts: dict[str, int], measured) -> None:
    report["failures"] = failures
    report["calls_compared"] = counts
    report["calls"] = measured


def failed_report(args, session_ids, failures, counts, measured) -> dict:
    report = {"model": args.model, "max_model_len": args.max_model_len, "sessions": []}
    report["planned_sessions"] = list(session_ids)
    add_failures(report, failures, counts, measured)
    return report


def print_failures(report: dict, out: TextIO) -> None:
    failures = report.get("failures") or []
    if not failures:
        return
    print(f"{len(failures)} failed call(s); the ledger covers the calls every stack completed:",
          file=out)  # fmt: skip
    for failure in failures:
        print(f"  {failure['error']}", file=out)
    measured = {
        stack: sum(len(rows) for rows in by_session.values())
        for stack, by_session in report["calls"].items()
    }
    compared = sum(report["calls_compared"].values())
    print(f"  calls measured per stack: {measured}; compared per stack: {compared}", file=out)


def failures_markdown(report: dict) -> list[str]:
    failures = report.get("failures") or []
    if not failures:
        return []
    lines = ["", "## Failed calls", ""]
    lines += [f"- `{f['error']}`" for f in failures]
    lines += ["", f"Calls compared per session: {report['calls_compared']}."]
    return lines
