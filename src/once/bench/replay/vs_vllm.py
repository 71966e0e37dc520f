"""once against vLLM on the same calls: the `vs_vllm` section of `once replay --baseline
vllm`, per source folder and in total.

The calls both columns completed (matched by session and call index) are summed into
one ledger per column:

    bytes_sent        client bytes on the wire (once: its WebSocket frames, new items
                      only on a continuation; vLLM: Chat Completions bodies, all of it)
    tokens_tokenized  once: what its gateway tokenized (a continuation's new items);
                      vLLM: usage.prompt_tokens (the whole rendered prompt, every call)
    prompt_tokens     the prompt each engine ran (the renders differ where vLLM's chat
                      template drops what once renders: SmolLM2's ignores tools and
                      tool calls); prompt_ratio says by how much
    computed_tokens   prompt tokens prefilled (once: its engine's count; vLLM: its
                      prefix-cache counters, queries - hits)
    ttft p50 / p90    client side, send -> first streamed output
    wall_s            the calls' send -> done, summed
    server_cpu_s      once: gateway + engine of the compared sessions (cpu.py); vLLM:
                      its process tree over the compared calls

and the ratios once / vLLM against the issue's bars:

    computed_ratio <= 1.0   tokenized_ratio <= 0.2   ttft_p50_ratio <= 0.8
    bytes_ratio <= 0.1      on append-only groups only (no compared call of once broke
                            its prefix, so once sent deltas); elsewhere `met` is None
"""

from __future__ import annotations

import numpy as np

BARS = {"computed_ratio": 1.0, "tokenized_ratio": 0.2, "bytes_ratio": 0.1, "ttft_p50_ratio": 0.8}
SUMS = ("bytes_sent", "tokens_tokenized", "prompt_tokens", "computed_tokens", "output_tokens")


def matched_calls(
    once_calls: dict[str, list[dict]], vllm_calls: dict[str, list[dict]], session_ids
) -> tuple[list[dict], list[dict]]:
    """(once's rows, vLLM's rows) of the calls both completed, in the same order."""
    once_rows, vllm_rows = [], []
    for session_id in session_ids:
        done = {row["index"]: row for row in vllm_calls.get(session_id, []) if "error" not in row}
        for row in once_calls.get(session_id, []):
            if row["index"] in done:
                once_rows.append(row)
                vllm_rows.append(done[row["index"]])
    return once_rows, vllm_rows


def column_ledger(rows: list[dict], server_cpu_s: float | None = None) -> dict:
    ledger: dict = {key: int(sum(row.get(key, 0) for row in rows)) for key in SUMS}
    ttfts = [row["ttft_s"] for row in rows]
    ledger["ttft_p50_s"] = _percentile(ttfts, 50)
    ledger["ttft_p90_s"] = _percentile(ttfts, 90)
    ledger["wall_s"] = round(sum(row["wall_s"] for row in rows), 3)
    ledger["server_cpu_s"] = None if server_cpu_s is None else round(server_cpu_s, 3)
    return ledger


def vs_vllm_row(once_rows: list[dict], vllm_rows: list[dict], once_cpu_s=None) -> dict:
    """The comparison of one group: both ledgers, the ratios, the bars."""
    vllm_cpu = sum(row.get("server_cpu_s", 0.0) for row in vllm_rows)
    once, vllm = column_ledger(once_rows, once_cpu_s), column_ledger(vllm_rows, vllm_cpu)
    append_only = bool(once_rows) and all(row["break_cause"] is None for row in once_rows)
    row: dict = {
        "calls": len(once_rows),
        "append_only": append_only,
        "computed_ratio": _ratio(once["computed_tokens"], vllm["computed_tokens"]),
        "tokenized_ratio": _ratio(once["tokens_tokenized"], vllm["tokens_tokenized"]),
        "bytes_ratio": _ratio(once["bytes_sent"], vllm["bytes_sent"]),
        "ttft_p50_ratio": _ratio(once["ttft_p50_s"], vllm["ttft_p50_s"]),
        "ttft_p90_ratio": _ratio(once["ttft_p90_s"], vllm["ttft_p90_s"]),
        "prompt_ratio": _ratio(once["prompt_tokens"], vllm["prompt_tokens"]),
        "wall_ratio": _ratio(once["wall_s"], vllm["wall_s"]),
        "server_cpu_ratio": _ratio(once["server_cpu_s"], vllm["server_cpu_s"]),
        "outputs_cut": sum(1 for r in vllm_rows if r.get("finish_reason") == "length"),
    }
    row["bars"] = {
        key: {"bar": f"<= {limit}", "met": _met(row[key], limit, key, append_only)}
        for key, limit in BARS.items()
    }
    return {**row, "once": once, "vllm": vllm}


def add_vs_vllm(report: dict, column: dict) -> None:
    """`vs_vllm` in every source row and the total; the column itself under `vllm`."""
    vllm_calls = column["calls"]
    once_calls = report["calls"]["once"]
    by_folder: dict[str, list[str]] = {}
    for session_id, rows in vllm_calls.items():
        if rows and session_id in once_calls:
            by_folder.setdefault(rows[0]["source_folder"], []).append(session_id)
    per_session_cpu = report.get("per_session", {}).get("once", {})
    groups = {**{f: ids for f, ids in by_folder.items() if f in report["sources"]}}
    groups["total"] = [s for ids in groups.values() for s in ids]
    for folder, session_ids in groups.items():
        once_rows, vllm_rows = matched_calls(once_calls, vllm_calls, session_ids)
        target = report["total"] if folder == "total" else report["sources"][folder]
        target["vs_vllm"] = vs_vllm_row(
            once_rows, vllm_rows, _server_cpu_s(per_session_cpu, session_ids)
        )
    failed = [row for rows in vllm_calls.values() for row in rows if "error" in row]
    report["vllm"] = {**column, "failed_calls": len(failed)}


def _server_cpu_s(per_session: dict, session_ids: list[str]) -> float | None:
    """once's gateway + engine CPU over the sessions (None where it was not measured)."""
    cpus = [per_session.get(s, {}).get("cpu_s") for s in session_ids]
    if not cpus or any(cpu is None for cpu in cpus):
        return None
    return sum(cpu["gateway"] + cpu["engine"] for cpu in cpus)


def summary_lines(report: dict) -> list[str]:
    """The printed summary's vs-vLLM lines (empty without the column)."""
    if "vllm" not in report or "vs_vllm" not in report["total"]:
        return []
    lines = [
        "vs vLLM (its OpenAI server, stateless Chat Completions, the full history every "
        "call; once / vLLM on the same calls):",
        f"  {'source folder':40} {'calls':>5} {'computed':>9} {'tokenized':>9} {'bytes':>7} "
        f"{'ttft p50':>8}",
    ]
    rows = {f: r["vs_vllm"] for f, r in report["sources"].items() if "vs_vllm" in r}
    for folder, row in {**rows, "total": report["total"]["vs_vllm"]}.items():
        lines.append(
            f"  {folder:40} {row['calls']:>5} {_num(row['computed_ratio']):>9} "
            f"{_num(row['tokenized_ratio']):>9} {_num(row['bytes_ratio']):>7} "
            f"{_num(row['ttft_p50_ratio']):>8}   {bar_verdicts(row)}"
        )
    total = report["total"]["vs_vllm"]
    for name in ("once", "vllm"):
        side = total[name]
        lines.append(
            f"  {name}: bytes {side['bytes_sent']}, tokenized {side['tokens_tokenized']}, prompt "
            f"{side['prompt_tokens']}, computed {side['computed_tokens']}; TTFT p50 "
            f"{side['ttft_p50_s']} s p90 {side['ttft_p90_s']} s; wall {side['wall_s']} s; "
            f"server CPU {side['server_cpu_s']} s"
        )
    column = report["vllm"]
    lines.append(
        f"  vLLM: {column['tokenized_means']}; outputs: {column['forcing']} "
        f"({total['outputs_cut']} cut); failed calls {column['failed_calls']}"
    )
    lines.append(f"  vLLM /v1/responses with previous_response_id: {probe_text(report['vllm'])}")
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
    """report.md's section (empty without the column)."""
    if "vllm" not in report or "vs_vllm" not in report["total"]:
        return []
    lines = [
        "## once vs vLLM (same calls)",
        "",
        "vLLM's OpenAI server, stateless Chat Completions with the full history every call; "
        f"tokenized: {report['vllm']['tokenized_means']}; computed: "
        f"{report['vllm']['computed_from']}; outputs: {report['vllm']['forcing']}. Ratios "
        "are once / vLLM; the bytes bar holds on append-only groups only.",
        "",
        "| source folder | calls | computed_ratio | tokenized_ratio | bytes_ratio "
        "| ttft_p50_ratio | bars |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = {f: r["vs_vllm"] for f, r in report["sources"].items() if "vs_vllm" in r}
    for folder, row in {**rows, "total": report["total"]["vs_vllm"]}.items():
        lines.append(
            f"| {folder} | {row['calls']} | {_num(row['computed_ratio'])} "
            f"| {_num(row['tokenized_ratio'])} | {_num(row['bytes_ratio'])} "
            f"| {_num(row['ttft_p50_ratio'])} | {bar_verdicts(row)} |"
        )
    lines += [
        "",
        "| column | bytes sent | tokenized | prompt | computed | TTFT p50 s | TTFT p90 s "
        "| wall s | server CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total = report["total"]["vs_vllm"]
    for name, side in (("once", total["once"]), ("vLLM", total["vllm"])):
        lines.append(
            f"| {name} | {side['bytes_sent']} | {side['tokens_tokenized']} "
            f"| {side['prompt_tokens']} | {side['computed_tokens']} | {side['ttft_p50_s']} "
            f"| {side['ttft_p90_s']} | {side['wall_s']} | {side['server_cpu_s']} |"
        )
    probe = probe_text(report["vllm"])
    lines += ["", f"vLLM's `/v1/responses` with `previous_response_id`: {probe}", ""]
    return lines


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
