"""once against each peer on the same calls: the `vs_vllm` and `vs_llamacpp` sections of
`once replay --baseline vllm,llamacpp`, per source folder and in total.

The calls both columns completed (matched by session and call index) are summed into
one ledger per column:

    bytes_sent        client bytes on the wire (once: its WebSocket frames, new items
                      only on a continuation; the peer: Chat Completions bodies, all of it)
    tokens_tokenized  once: what its gateway tokenized (a continuation's new items);
                      the peer: usage.prompt_tokens (the whole rendered prompt, every call)
    prompt_tokens     the prompt each engine ran (the renders differ where the peer's
                      chat template drops what once renders: SmolLM2's ignores tools and
                      tool calls); prompt_ratio says by how much, prompt_differs on how
                      many calls
    computed_tokens   prompt tokens prefilled (once: its engine's count; vLLM: its
                      prefix-cache counters, queries - hits; llama.cpp: timings.prompt_n)
    ttft p50 / p90    client side, send -> first streamed output
    wall_s            the calls' send -> done, summed
    server_cpu_s      once: gateway + engine of the compared sessions (cpu.py); the
                      peer: its processes over the compared calls

and the ratios once / peer against issue 29's bars (set for vLLM; llama.cpp's server is
held to the same):

    computed_ratio <= 1.0   tokenized_ratio <= 0.2   ttft_p50_ratio <= 0.8
    bytes_ratio <= 0.1      on append-only groups only (no compared call of once broke
                            its prefix, so once sent deltas); elsewhere `met` is None
"""

from __future__ import annotations

import numpy as np

BARS = {"computed_ratio": 1.0, "tokenized_ratio": 0.2, "bytes_ratio": 0.1, "ttft_p50_ratio": 0.8}
SUMS = ("bytes_sent", "tokens_tokenized", "prompt_tokens", "computed_tokens", "output_tokens")
PEER_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}  # the JSON's name -> the printed one


def matched_calls(
    once_calls: dict[str, list[dict]], peer_calls: dict[str, list[dict]], session_ids
) -> tuple[list[dict], list[dict]]:
    """(once's rows, the peer's rows) of the calls both completed, in the same order."""
    once_rows, peer_rows = [], []
    for session_id in session_ids:
        done = {row["index"]: row for row in peer_calls.get(session_id, []) if "error" not in row}
        for row in once_calls.get(session_id, []):
            if row["index"] in done:
                once_rows.append(row)
                peer_rows.append(done[row["index"]])
    return once_rows, peer_rows


def column_ledger(rows: list[dict], server_cpu_s: float | None = None) -> dict:
    ledger: dict = {key: int(sum(row.get(key, 0) for row in rows)) for key in SUMS}
    ttfts = [row["ttft_s"] for row in rows]
    ledger["ttft_p50_s"] = _percentile(ttfts, 50)
    ledger["ttft_p90_s"] = _percentile(ttfts, 90)
    ledger["wall_s"] = round(sum(row["wall_s"] for row in rows), 3)
    ledger["server_cpu_s"] = None if server_cpu_s is None else round(server_cpu_s, 3)
    return ledger


def vs_peer_row(peer: str, once_rows: list[dict], peer_rows: list[dict], once_cpu_s=None) -> dict:
    """The comparison of one group: both ledgers (under "once" and the peer's name), the
    ratios, the bars."""
    peer_cpu = sum(row.get("server_cpu_s", 0.0) for row in peer_rows)
    once, other = column_ledger(once_rows, once_cpu_s), column_ledger(peer_rows, peer_cpu)
    append_only = bool(once_rows) and all(row["break_cause"] is None for row in once_rows)
    row: dict = {
        "calls": len(once_rows),
        "append_only": append_only,
        "computed_ratio": _ratio(once["computed_tokens"], other["computed_tokens"]),
        "tokenized_ratio": _ratio(once["tokens_tokenized"], other["tokens_tokenized"]),
        "bytes_ratio": _ratio(once["bytes_sent"], other["bytes_sent"]),
        "ttft_p50_ratio": _ratio(once["ttft_p50_s"], other["ttft_p50_s"]),
        "ttft_p90_ratio": _ratio(once["ttft_p90_s"], other["ttft_p90_s"]),
        "prompt_ratio": _ratio(once["prompt_tokens"], other["prompt_tokens"]),
        "prompt_differs": sum(map(_prompts_differ, once_rows, peer_rows)),
        "wall_ratio": _ratio(once["wall_s"], other["wall_s"]),
        "server_cpu_ratio": _ratio(once["server_cpu_s"], other["server_cpu_s"]),
        "outputs_cut": sum(1 for r in peer_rows if r.get("finish_reason") == "length"),
    }
    row["bars"] = {
        key: {"bar": f"<= {limit}", "met": _met(row[key], limit, key, append_only)}
        for key, limit in BARS.items()
    }
    return {**row, "once": once, peer: other}


def _prompts_differ(once_row: dict, peer_row: dict) -> bool:
    return once_row.get("prompt_tokens") != peer_row.get("prompt_tokens")


def add_vs_peer(report: dict, peer: str, column: dict) -> None:
    """`vs_<peer>` in every source row and the total; the column itself under `<peer>`."""
    peer_calls = column["calls"]
    once_calls = report["calls"]["once"]
    by_folder: dict[str, list[str]] = {}
    for session_id, rows in peer_calls.items():
        if rows and session_id in once_calls:
            by_folder.setdefault(rows[0]["source_folder"], []).append(session_id)
    per_session_cpu = report.get("per_session", {}).get("once", {})
    groups = {f: ids for f, ids in by_folder.items() if f in report["sources"]}
    groups["total"] = [s for ids in groups.values() for s in ids]
    for folder, session_ids in groups.items():
        once_rows, peer_rows = matched_calls(once_calls, peer_calls, session_ids)
        target = report["total"] if folder == "total" else report["sources"][folder]
        target[f"vs_{peer}"] = vs_peer_row(
            peer, once_rows, peer_rows, _server_cpu_s(per_session_cpu, session_ids)
        )
    failed = [row for rows in peer_calls.values() for row in rows if "error" in row]
    report[peer] = {**column, "failed_calls": len(failed)}


def _server_cpu_s(per_session: dict, session_ids: list[str]) -> float | None:
    """once's gateway + engine CPU over the sessions (None where it was not measured)."""
    cpus = [per_session.get(s, {}).get("cpu_s") for s in session_ids]
    if not cpus or any(cpu is None for cpu in cpus):
        return None
    return sum(cpu["gateway"] + cpu["engine"] for cpu in cpus)


def compared_peers(report: dict) -> list[str]:
    return [p for p in PEER_NAMES if p in report and f"vs_{p}" in report["total"]]


def summary_lines(report: dict) -> list[str]:
    """The printed summary's lines, a block per peer (none without a column)."""
    lines: list[str] = []
    for peer in compared_peers(report):
        name, column = PEER_NAMES[peer], report[peer]
        lines += [
            f"vs {name} ({column['sends']}; once / {name} on the same calls):",
            f"  {'source folder':40} {'calls':>5} {'computed':>9} {'tokenized':>9} "
            f"{'bytes':>7} {'ttft p50':>8}",
        ]
        for folder, row in _groups(report, peer).items():
            lines.append(
                f"  {folder:40} {row['calls']:>5} {_num(row['computed_ratio']):>9} "
                f"{_num(row['tokenized_ratio']):>9} {_num(row['bytes_ratio']):>7} "
                f"{_num(row['ttft_p50_ratio']):>8}   {bar_verdicts(row)}"
            )
        total = report["total"][f"vs_{peer}"]
        for side in ("once", peer):
            figures = total[side]
            lines.append(
                f"  {side}: bytes {figures['bytes_sent']}, tokenized "
                f"{figures['tokens_tokenized']}, prompt {figures['prompt_tokens']}, computed "
                f"{figures['computed_tokens']}; TTFT p50 {figures['ttft_p50_s']} s p90 "
                f"{figures['ttft_p90_s']} s; wall {figures['wall_s']} s; server CPU "
                f"{figures['server_cpu_s']} s"
            )
        lines.append(
            f"  {name}: {column['tokenized_means']}; outputs: {column['forcing']} "
            f"({total['outputs_cut']} cut); prompts of another length than once's: "
            f"{total['prompt_differs']} of {total['calls']} calls; failed calls "
            f"{column['failed_calls']}"
        )
        if "responses_probe" in column:
            lines.append(f"  {name} /v1/responses with previous_response_id: {probe_text(column)}")
    return lines


def bar_verdicts(row: dict) -> str:
    words = []
    for key, bar in row["bars"].items():
        met = bar["met"]
        verdict = "n/a" if met is None else "met" if met else "NOT met"
        words.append(f"{key.removesuffix('_ratio')} {bar['bar']} {verdict}")
    return "; ".join(words)


def probe_text(column: dict) -> str:
    probe = column.get("responses_probe") or {}
    calls = probe.get("calls") or []
    if probe.get("previous_response_id_works"):
        second = calls[-1]
        return (
            f"works (second call: {second['input_tokens']} input tokens, "
            f"{second['cached_tokens']} cached)"
        )
    last = calls[-1] if calls else {}
    return f"fails, HTTP {last.get('status')}: {last.get('error')}"


def markdown_lines(report: dict) -> list[str]:
    """report.md's sections, one per peer (none without a column)."""
    lines: list[str] = []
    for peer in compared_peers(report):
        name, column = PEER_NAMES[peer], report[peer]
        lines += [
            f"## once vs {name} (same calls)",
            "",
            f"{name}: {column['sends']}; tokenized: {column['tokenized_means']}; computed: "
            f"{column['computed_from']}; outputs: {column['forcing']}. Ratios are once / "
            f"{name}; the bytes bar holds on append-only groups only.",
            "",
            "| source folder | calls | computed_ratio | tokenized_ratio | bytes_ratio "
            "| ttft_p50_ratio | prompt_ratio | bars |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for folder, row in _groups(report, peer).items():
            lines.append(
                f"| {folder} | {row['calls']} | {_num(row['computed_ratio'])} "
                f"| {_num(row['tokenized_ratio'])} | {_num(row['bytes_ratio'])} "
                f"| {_num(row['ttft_p50_ratio'])} | {_num(row['prompt_ratio'])} "
                f"| {bar_verdicts(row)} |"
            )
        lines += [
            "",
            "| column | bytes sent | tokenized | prompt | computed | TTFT p50 s | TTFT p90 s "
            "| wall s | server CPU s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        total = report["total"][f"vs_{peer}"]
        for side, label in (("once", "once"), (peer, name)):
            figures = total[side]
            lines.append(
                f"| {label} | {figures['bytes_sent']} | {figures['tokens_tokenized']} "
                f"| {figures['prompt_tokens']} | {figures['computed_tokens']} "
                f"| {figures['ttft_p50_s']} | {figures['ttft_p90_s']} | {figures['wall_s']} "
                f"| {figures['server_cpu_s']} |"
            )
        if "responses_probe" in column:
            lines += ["", f"{name}'s `/v1/responses` with `previous_response_id`: "
                      f"{probe_text(column)}"]  # fmt: skip
        lines.append("")
    return lines


def _groups(report: dict, peer: str) -> dict[str, dict]:
    """Each source folder's vs_<peer> row, then the total's."""
    key = f"vs_{peer}"
    rows = {f: r[key] for f, r in report["sources"].items() if key in r}
    return {**rows, "total": report["total"][key]}


def _met(value: float | None, limit: float, key: str, append_only: bool) -> bool | None:
    if value is None or (key == "bytes_ratio" and not append_only):
        return None
    return value <= limit


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None
