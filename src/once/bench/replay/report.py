"""The replay report for people: Markdown with PNG plots, next to the JSON for machines.

`write_report(report, out)` writes into the folder `out`:

    report.json          the whole report (what `--json` prints)
    report.md            headline figures per source folder against the bar, the ledger per
                         stack, miss causes, ablation and traffic settings when run
    prefill_per_call.png prompt tokens computed per call, once vs naive, one panel per source
    cumulative_cost.png  the same accumulated over each session's calls
    miss_causes.png      computed prompt tokens by cause, one bar per stack
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from once.bench.replay.failures import failures_markdown  # noqa: E402
from once.bench.replay.vs_peers import markdown_lines as vs_peers_markdown  # noqa: E402

BAR_FACTOR = 1.25  # computed_ratio must stay within 1.25x the ideal ratio
PLOTS = ("prefill_per_call.png", "cumulative_cost.png", "miss_causes.png")


def write_report(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    if not report["sessions"]:  # no call completed on every stack (failures.py)
        lines = [
            "# once replay",
            "",
            "No call completed on every stack.",
            *failures_markdown(report),
        ]
        (out / "report.md").write_text("\n".join(lines) + "\n")
        return [out / "report.json", out / "report.md"]
    plot_prefill_per_call(report, out / PLOTS[0])
    plot_cumulative_cost(report, out / PLOTS[1])
    plot_miss_causes(report, out / PLOTS[2])
    (out / "report.md").write_text(markdown(report))
    return [out / "report.json", out / "report.md", *(out / name for name in PLOTS)]


def markdown(report: dict) -> str:
    lines = [
        "# once replay",
        "",
        f"{len(report['sessions'])} sessions; model `{report['model']}` (tokenizer "
        f"`{report['tokenizer']}`), weights: {report.get('weights', 'n/a')}; context cap "
        f"{report['max_model_len']} tokens ({report.get('calls_cut_by_context', 0)} recorded "
        f"calls past it not replayed), KV block {report['block_size']} tokens.",
        "",
        "## Prompt tokens computed, once / naive, per source folder",
        "",
        f"Bar: `computed_ratio` <= {BAR_FACTOR} x `ideal_ratio` (an unlimited per-session "
        "prefix cache). `shared_ideal_ratio` is an unlimited cache shared by all sessions: "
        "no stack can compute less (checked).",
        "",
        "| source folder | sessions | computed_ratio | ideal_ratio | shared_ideal_ratio | bar "
        "| bytes_ratio | tokenized_ratio | wall_ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for folder, row in {**report["sources"], "total": report["total"]}.items():
        lines.append(
            f"| {folder} | {row['once']['sessions']} | {_fmt(row['computed_ratio'])} "
            f"| {_fmt(row['ideal_ratio'])} | {_fmt(row.get('shared_ideal_ratio'))} "
            f"| {_verdict(row)} | {_fmt(row['bytes_ratio'])} "
            f"| {_fmt(row['tokenized_ratio'])} | {_fmt(row['wall_ratio'])} |"
        )
    lines += ["", f"Unattributed misses: **{report['unattributed_misses']}** tokens.", ""]
    lines += _checks_section(report)
    lines += _ledger_section(report)
    if report.get("prefill_ratio") is not None:
        lines += _prefill_section(report)
    if report.get("ablation"):
        lines += _ablation_section(report["ablation"])
    if report.get("traffic"):
        lines += _traffic_section(report["traffic"])
    lines += vs_peers_markdown(report)
    lines += failures_markdown(report)
    lines += ["## Plots", ""]
    lines += [f"![{name.removesuffix('.png')}]({name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


def _checks_section(report: dict) -> list[str]:
    invariants, bound = report.get("ledger_invariants"), report.get("shared_ideal")
    lines = []
    if invariants:
        verdict = "hold" if invariants["holds"] else "**BROKEN**"
        lines.append(
            f"Ledger invariants (prompt = cached + computed - recomputed; computed = its "
            f"causes) {verdict} on {invariants['calls_checked']} calls"
            + ("." if invariants["holds"] else ":")
        )
        lines += [f"- {violation}" for violation in invariants["violations"]]
    if bound:
        verdict = "holds" if bound["holds"] else "**BEATEN** (a count is wrong)"
        lines.append(f"Shared-cache bound on every stack and source: {verdict}.")
        lines += [f"- {line}" for line in bound["beaten"]]
    return [*lines, ""] if lines else []


def _ledger_section(report: dict) -> list[str]:
    lines = [
        "## Ledger (all sessions)",
        "",
        "| stack | bytes received | bytes new | tokens tokenized | prompt tokens | cached "
        "| computed | output | TTFT p50 s | TTFT p95 s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, total in _stack_totals(report).items():
        lines.append(
            f"| {name} | {total['bytes_received']} | {total['bytes_new']} "
            f"| {total['tokens_tokenized']} | {total['prompt_tokens']} | {total['cached_tokens']} "
            f"| {total['computed_tokens']} | {total['output_tokens']} | {total['ttft_p50_s']} "
            f"| {total['ttft_p95_s']} | {total['wall_s']} |"
        )
    lines += ["", "### Computed prompt tokens by cause", ""]
    for name, total in _stack_totals(report).items():
        causes = ", ".join(f"{k} {v}" for k, v in total["miss_causes"].items()) or "none"
        lines.append(f"- **{name}**: {causes}")
    return [*lines, ""]


def _prefill_section(report: dict) -> list[str]:
    prefill = report.get("prefill_s", {})
    lines = [
        "## Prefill and wall time",
        "",
        f"Engine prefill: once {prefill.get('once')} s, naive {prefill.get('naive')} s; "
        f"`prefill_ratio` (naive / once) **{report['prefill_ratio']}**.",
    ]
    if report.get("wall_ratio_vs_transformers_reuse") is not None:
        lines.append(
            "`wall_ratio_vs_transformers_reuse` (once / transformers with prefix reuse) "
            f"**{report['wall_ratio_vs_transformers_reuse']}**."
        )
    return [*lines, ""]


def _ablation_section(rows: list[dict]) -> list[str]:
    lines = [
        "## Ablation: each optimization switched off in turn",
        "",
        "Saved = the variant's cost minus the full once stack's (same sessions, same run). "
        "Stacks run one after another, so wall time carries warm-up and machine noise: "
        "read it only where the gap is large.",
        "",
        "| switched off | bytes received (saved) | tokens tokenized (saved) "
        "| tokens computed (saved) | wall s (saved) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"{row[r]} ({row[r + '_saved']})" for r in _RESOURCES]
        lines.append(f"| {row['switched_off']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


_RESOURCES = ("bytes_received", "tokens_tokenized", "computed_tokens", "wall_s")


def _traffic_section(traffic: dict) -> list[str]:
    lines = [
        "## Traffic",
        "",
        f"Concurrency {traffic['concurrency']}, pacing `{traffic['pacing']}`, time scale "
        f"{traffic['time_scale']}.",
        "",
    ]
    for name, wall in traffic.get("stack_wall_s", {}).items():
        lines.append(f"- {name}: all sessions in {wall} s")
    origins = sorted(set(traffic.get("tool_time_origins", {}).values()))
    if origins:
        lines.append(f"- tool time from: {', '.join(origins)}")
    return [*lines, ""]


def _stack_totals(report: dict) -> dict[str, dict]:
    totals = {name: report["total"][name] for name in ("once", "naive")}
    totals.update(report.get("ablation_totals", {}))
    return totals


def _verdict(row: dict) -> str:
    computed, ideal = row["computed_ratio"], row["ideal_ratio"]
    if computed is None or ideal is None:
        return "n/a"
    return "pass" if computed <= BAR_FACTOR * ideal else "FAIL"


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _calls_by_folder(report: dict, stack: str) -> dict[str, list[list[dict]]]:
    folders: dict[str, list[list[dict]]] = {}
    for rows in report["calls"].get(stack, {}).values():
        if rows:
            folders.setdefault(rows[0].get("source_folder", rows[0]["source"]), []).append(rows)
    return folders


def _panels(report: dict):
    folders = sorted(report["sources"]) or ["(none)"]
    figure, axes = plt.subplots(
        len(folders), 1, figsize=(8, 2.6 * len(folders)), squeeze=False, sharex=False
    )
    return figure, dict(zip(folders, axes[:, 0], strict=True))


def plot_prefill_per_call(report: dict, path: Path) -> None:
    figure, panels = _panels(report)
    for stack, style in (("once", "-"), ("naive", "--")):
        for folder, sessions in _calls_by_folder(report, stack).items():
            axis = panels[folder]
            for number, rows in enumerate(sessions):
                label = stack if number == 0 else None
                axis.plot([r["computed_tokens"] for r in rows], style, label=label, lw=1)
            axis.set_title(folder, fontsize=9)
            axis.set_ylabel("tokens computed")
            axis.legend(fontsize=7)
    _finish(figure, path, "call index")


def plot_cumulative_cost(report: dict, path: Path) -> None:
    figure, panels = _panels(report)
    for stack, style in (("once", "-"), ("naive", "--")):
        for folder, sessions in _calls_by_folder(report, stack).items():
            axis = panels[folder]
            for number, rows in enumerate(sessions):
                running, total = [], 0
                for row in rows:
                    total += row["computed_tokens"]
                    running.append(total)
                axis.plot(running, style, label=stack if number == 0 else None, lw=1)
            axis.set_title(folder, fontsize=9)
            axis.set_ylabel("cumulative tokens")
            axis.legend(fontsize=7)
    _finish(figure, path, "call index")


def plot_miss_causes(report: dict, path: Path) -> None:
    totals = _stack_totals(report)
    causes = sorted({cause for total in totals.values() for cause in total["miss_causes"]})
    figure, axis = plt.subplots(figsize=(8, 1 + 0.5 * len(totals)))
    names = list(totals)
    left = [0] * len(names)
    for cause in causes:
        widths = [totals[name]["miss_causes"].get(cause, 0) for name in names]
        axis.barh(names, widths, left=left, label=cause)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axis.set_xlabel("prompt tokens computed")
    if causes:
        axis.legend(fontsize=7, loc="lower right")
    _finish(figure, path, None)


def _finish(figure, path: Path, xlabel: str | None) -> None:
    if xlabel:
        figure.axes[-1].set_xlabel(xlabel)
        for axis in figure.axes:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
