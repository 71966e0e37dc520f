"""`once bench reliability [--json] [--quick]`: every reliability part, one summary.

In order: the API fuzzed (fuzz.py), faults injected (faults.py), load (load.py), early
rejection of over-long prompts (rejection.py), sandbox escape attempts (sandbox.py) and
requests their clients abandoned (abandoned.py).
Each part is imported when it runs; a part whose module is not there, or that fails, is
recorded as not run (with why) and its bars as unmet, and the others still run. The
summary is one flat dict of every part's figures, plus `bars`: {bar: {value, target,
met}}, printed as a table; `--json` also writes it to results/bench_reliability.json.
`--quick` runs small budgets: a smoke test of the wiring, not the bars' figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import operator
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_reliability.json"

# (figure, comparison, target): the bars.
BARS: tuple[tuple[str, str, float], ...] = (
    ("fuzz_5xx", "==", 0),
    ("ws_unanswered", "==", 0),
    ("schema_violations", "==", 0),
    ("sessions_lost", "==", 0),
    ("stored_responses_lost", "==", 0),
    ("load_sessions", "==", 256),
    ("load_errors", "==", 0),
    ("gateway_memory_growth_mb_per_1k_sessions", "<=", 5),
    ("max_rejection_cpu_ms", "<=", 50),
    ("sandbox_escapes", "==", 0),
    ("abandoned_tokens_after_1s", "==", 0),
)
PART_NAMES = ("fuzz", "faults", "load", "rejection", "sandbox", "abandoned")
_COMPARE = {"==": operator.eq, "<=": operator.le, ">=": operator.ge}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parts(args) -> list[tuple[str, str, Callable[[object], dict]]]:
    """(name, module, how to run its entry point) in the order they run."""
    # 180 s: memory is a high-water mark still rising a minute in (60 s runs read slopes of
    # 1.2-6.8 MB/1k on the same code; 180 s, flat for its last 1,700 sessions, 0.36).
    load_sessions, load_seconds = (16, 5.0) if args.quick else (256, 180.0)
    load_shape = {"calls_per_session": 3, "think_s": 0.2} if args.quick else {}
    return [
        ("fuzz", "once.bench.reliability.fuzz",
         lambda m: m.run_fuzz(args.fuzz_requests or (200 if args.quick else 5000))),
        ("faults", "once.bench.reliability.faults", lambda m: m.run_faults()),
        ("load", "once.bench.reliability.load",
         lambda m: m.run_load(args.load_sessions or load_sessions,
                              args.load_seconds or load_seconds, **load_shape)),
        ("rejection", "once.bench.reliability.rejection",
         lambda m: m.run_rejection(repeats=1 if args.quick else 3)),
        ("sandbox", "once.bench.reliability.sandbox", lambda m: m.run_attempts()),
        ("abandoned", "once.bench.reliability.abandoned", lambda m: m.run_abandoned()),
    ]  # fmt: skip


def run_part(name: str, module_name: str, run: Callable[[object], dict]) -> tuple[dict, dict]:
    """(its figures, its record): figures empty and the record saying why when not run."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module is there and lacks something: a bug to see, not a gap
        return {}, {"not_run": "module missing"}
    started = time.perf_counter()
    try:
        figures = run(module)
    except Exception as e:  # noqa: BLE001 - one part's failure must not hide the others'
        traceback.print_exc()
        return {}, {"not_run": f"failed: {type(e).__name__}: {e}"[:500]}
    return figures, {"seconds": round(time.perf_counter() - started, 1)}


def bars(summary: dict) -> dict:
    table = {}
    for key, comparison, target in BARS:
        value = summary.get(key)
        met = isinstance(value, int | float) and _COMPARE[comparison](value, target)
        table[key] = {"value": value, "target": f"{comparison} {target:g}", "met": bool(met)}
    return table


def run(args) -> dict:
    summary: dict = {"quick": args.quick}
    for name, module_name, entry in parts(args):
        if args.parts and name not in args.parts:
            summary[name] = {"not_run": "not selected"}
            continue
        _log(f"reliability: {name} ...")
        figures, record = run_part(name, module_name, entry)
        summary.update(figures)
        summary[name] = record
    summary["bars"] = bars(summary)
    return summary


def format_table(summary: dict) -> str:
    lines = [f"{'bar':<42} {'value':>12} {'target':>10}  met"]
    for key, bar in summary["bars"].items():
        value = bar["value"]
        shown = "-" if value is None else f"{value:.3g}" if isinstance(value, float) else value
        met = "yes" if bar["met"] else "no"
        lines.append(f"{key:<42} {shown!s:>12} {bar['target']:>10}  {met}")
    for name in PART_NAMES:
        record = summary.get(name, {})
        if "not_run" in record:
            lines.append(f"{name}: not run ({record['not_run']})")
    figures = ("fuzz_requests", "ws_requests", "load_completed_sessions", "load_requests",
               "load_added_ms_p50", "load_added_ms_p99", "gateway_rss_mb_start",
               "gateway_rss_mb_end", "sandbox_attempts", "abandoned_requests")  # fmt: skip
    for key in figures:
        if key in summary:
            value = summary[key]
            lines.append(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="once bench reliability", description=__doc__)
    parser.add_argument("--json", action="store_true", help=f"also write {DEFAULT_OUT.name}")
    parser.add_argument("--quick", action="store_true", help="small budgets: a smoke test")
    parser.add_argument(
        "--parts", nargs="+", choices=PART_NAMES, default=None, help="run only these parts"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--fuzz-requests", type=int, default=0, help="0: the default budget")
    parser.add_argument("--load-sessions", type=int, default=0, help="0: 256 (16 quick)")
    parser.add_argument("--load-seconds", type=float, default=0, help="0: 180 (5 quick)")
    args = parser.parse_args(argv)
    summary = run(args)
    print(format_table(summary))
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        _log(f"wrote {args.out}")
    failed = [name for name in PART_NAMES if "failed" in summary[name].get("not_run", "")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
