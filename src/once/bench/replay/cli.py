"""`once replay`: recorded agent sessions through the once and naive stacks, one ledger.

Each session is planned once (rendered with the served model's tokenizer), then replayed
through the `once` stack and through the `naive` stack, one call at a time as its agent
ran. The output is the ledger per session, per source folder and in total, and the
headline figures per source folder: `computed_ratio` (prompt tokens computed, once /
naive) next to `ideal_ratio` (an unlimited per-session prefix cache), and the total of
`unattributed_misses` (computed prompt tokens no cause explains).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from once.bench.replay.ledger import UNATTRIBUTED, by_group, compare, merge, session_ledger
from once.bench.replay.plan import SessionPlan, plan_session
from once.bench.replay.replay import replay_session
from once.bench.replay.sessions import find_session, sample_names
from once.bench.replay.stacks import (
    NAIVE,
    ONCE,
    TINY,
    TOKENIZER_MODEL,
    load_served_runtime,
    make_tiny_replay_model,
    open_stack,
)

DEFAULT_MAX_MODEL_LEN = 32768
STACKS = {"once": ONCE, "naive": NAIVE}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="once replay", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sessions",
        nargs="+",
        help="session names (<folder>/<stem> or a unique stem); default: the named sample",
    )
    parser.add_argument("--model", default=TINY, help="'tiny' (random weights) or a model name")
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--max-calls", type=int, help="replay only the first N calls")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--json", action="store_true", help="print the JSON report")
    parser.add_argument("--out", type=Path, help="also write report.json here (a folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_model_len < 2 or (args.max_calls is not None and args.max_calls < 1):
        print("error: --max-model-len must be >= 2 and --max-calls >= 1", file=sys.stderr)
        return 2
    try:
        names = args.sessions or sample_names()
        sessions = [find_session(name) for name in names]
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = asyncio.run(run_replay(sessions, args))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_summary(report)
    return 0


async def run_replay(sessions, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="once-replay-") as tmp:
        if args.model == TINY:
            folder = make_tiny_replay_model(Path(tmp) / "tiny", args.max_model_len)
        else:
            from once.engine.loader import resolve_model_path

            folder = Path(resolve_model_path(args.model))
        runtime = load_served_runtime(folder, args.max_model_len)
        plans = []
        for source_folder, session in sessions:
            plan = plan_session(
                session, runtime, max_calls=args.max_calls, max_model_len=args.max_model_len
            )
            if plan.calls:
                plans.append((source_folder, plan))
            else:
                _log(f"skip {session.session_id}: its first call does not fit")
        records: dict[str, dict[str, list[dict]]] = {}
        counters = {}
        for name, spec in STACKS.items():
            async with open_stack(
                spec, runtime, folder, max_model_len=args.max_model_len,
                kv_cache_gib=args.kv_cache_gib,
            ) as stack:  # fmt: skip
                records[name] = {}
                for source_folder, plan in plans:
                    started = time.perf_counter()
                    rows = await replay_session(stack, plan)
                    for row in rows:
                        row["source_folder"] = source_folder
                    records[name][plan.session_id] = rows
                    _log(
                        f"{name:5} {plan.session_id}: {len(rows)} calls in "
                        f"{time.perf_counter() - started:.1f} s"
                    )
                counters[name] = await stack.counters()
                block_size = stack.engine.engine.config.block_size
    return build_report(plans, records, counters, block_size, args)


def build_report(plans: list[tuple[str, SessionPlan]], records, counters, block_size, args):
    ledgers: dict[str, dict[str, dict]] = {}
    for name, spec in STACKS.items():
        ledgers[name] = {
            session_id: session_ledger(
                rows, block_size=block_size, prefix_caching=spec.prefix_caching
            )
            for session_id, rows in records[name].items()
        }
    folder_of = {plan.session_id: folder for folder, plan in plans}
    groups = by_group([plan.session_id for _, plan in plans], folder_of.__getitem__)
    sources = {}
    for folder, session_ids in sorted(groups.items()):
        side = {
            name: merge(
                [ledgers[name][s] for s in session_ids],
                [row for s in session_ids for row in records[name][s]],
            )
            for name in STACKS
        }
        sources[folder] = {**compare(side["once"], side["naive"]), **side}
    all_ids = [plan.session_id for _, plan in plans]
    total = {
        name: merge(
            [ledgers[name][s] for s in all_ids], [r for s in all_ids for r in records[name][s]]
        )
        for name in STACKS
    }
    unattributed = sum(
        ledger["miss_causes"].get(UNATTRIBUTED, 0)
        for name in STACKS
        for ledger in ledgers[name].values()
    )
    return {
        "model": args.model,
        "tokenizer": TOKENIZER_MODEL,
        "max_model_len": args.max_model_len,
        "block_size": block_size,
        "sessions": all_ids,
        "sources": sources,
        "total": {**compare(total["once"], total["naive"]), **total},
        "unattributed_misses": unattributed,
        "per_session": ledgers,
        "counters": counters,
        "calls": records,
    }


def print_summary(report: dict, out=sys.stdout) -> None:
    print(f"once replay: {len(report['sessions'])} sessions, model {report['model']}", file=out)
    header = f"{'source folder':40} {'computed':>9} {'ideal':>7} {'bytes':>7} {'tokenized':>9}"
    print(header, file=out)
    for folder, row in {**report["sources"], "total": report["total"]}.items():
        print(
            f"{folder:40} {row['computed_ratio']:>9.3f} {row['ideal_ratio']:>7.3f} "
            f"{row['bytes_ratio']:>7.3f} {row['tokenized_ratio']:>9.3f}",
            file=out,
        )
    for name in STACKS:
        total = report["total"][name]
        causes = ", ".join(f"{k} {v}" for k, v in total["miss_causes"].items())
        print(
            f"{name}: prompt {total['prompt_tokens']} tokens, computed {total['computed_tokens']}"
            f", cached {total['cached_tokens']}; TTFT p50 {total['ttft_p50_s']} s p95 "
            f"{total['ttft_p95_s']} s; wall {total['wall_s']} s\n  computed by cause: {causes}",
            file=out,
        )
    print(f"unattributed misses: {report['unattributed_misses']} tokens", file=out)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
