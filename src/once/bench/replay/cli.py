"""`once replay`: recorded agent sessions through the once and naive stacks, one ledger.

Each session is planned once (rendered with the served model's tokenizer), then replayed
through the `once` stack and through the `naive` stack, one call at a time as its agent
ran. The output is the ledger per session, per source folder and in total, and the
headline figures per source folder: `computed_ratio` (prompt tokens computed, once /
naive) next to `ideal_ratio` (an unlimited per-session prefix cache) and
`shared_ideal_ratio` (an unlimited cache shared by all sessions: the bound no stack can
beat), and the total of `unattributed_misses` (computed prompt tokens no cause explains).
Every call of every stack is checked against the ledger's invariants and every stack
against the shared bound (checks.py); a replay that breaks either exits 1.

Routing (`--replicas N`, N > 1): the engine becomes a router over N `once engine`
processes, the last `--slow-replicas K` of them throttled to 1/`--slowdown` speed, each
with `--replica-threads` threads (default: the cores / N). The once stack runs once per
policy of `--policies` (router/policies.py names: once, session_affinity, round_robin,
least_loaded, power_of_two, cache_aware, dynamo; `once` is required and is the stack
the ledger reports), the naive stack round-robin over the N replicas, and a once stack on
one in-process engine as the reference for cached tokens; every stack gets fresh
replicas. The JSON gains a `routing` section (routing.py). A call that fails with
`engine_unavailable` (a replica died mid-response) is retried, at most 3 sends.

Live vLLM (`--engine vllm`, N >= 1): the routed stacks run over N live vLLM servers
(vllm_pool.py; `make vllm` installs vLLM) instead of `once engine` processes, started once
and emptied between stacks; `--vllm-kv-mib` sizes each one's KV cache (default: one
request of --max-model-len, +10%). The JSON's `routing` section gains vLLM's own counters
per policy and `vllm_live: true`.

Named baselines (`--baseline transformers,vllm,llamacpp`): transformers with prefix reuse
(baseline.py) before the stacks; vLLM's and llama.cpp's own OpenAI servers after them, the
calls as their clients sent them (chat_column.py with vllm_baseline.py and
llamacpp_baseline.py), compared per source in `vs_vllm` and `vs_llamacpp` (vs_peers.py).

Disaggregation (`--pd P:D`): two more once stacks, colocated over P + D engine processes
and over P prefill and D decode engines; the JSON gains a `pd` section (pd.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from once.bench.replay.ablation import ABLATIONS, NO_SPECULATION, ablation_table
from once.bench.replay.baseline import print_second_bar, run_transformers_baseline, second_bar
from once.bench.replay.baseline_session import (
    add_session_mode_arguments,
    cut_outputs,
    kv_cache_gib_for,
    resolve_session_mode,
)
from once.bench.replay.checks import (
    check_disaggregated_bound,
    ledger_invariants,
    run_description,
    shared_ideal,
)
from once.bench.replay.cpu import add_cpu_seconds, cpu_line
from once.bench.replay.failures import (
    add_failures,
    collect,
    compared_calls,
    failed_report,
    print_failures,
    trim,
)
from once.bench.replay.kv_pressure import (
    add_kv_pressure_arguments,
    check_kv_pressure_args,
    kv_pressure_section,
    pressure_runs,
    print_kv_pressure,
    stack_totals,
)
from once.bench.replay.ledger import UNATTRIBUTED, by_group, compare, merge, session_ledger
from once.bench.replay.llamacpp_baseline import (
    LLAMACPP,
    check_llamacpp_baseline,
    run_llamacpp_column,
)
from once.bench.replay.pacing import FAST, PACINGS
from once.bench.replay.pd import (
    DISAGGREGATED,
    SHARED_KV,
    add_pd_arguments,
    check_pd_args,
    disaggregated_work,
    format_pd_section,
    parse_pd,
    pd_observations,
    pd_runs,
    pd_section,
)
from once.bench.replay.plan import SessionPlan, plan_session
from once.bench.replay.replicas import default_replica_threads
from once.bench.replay.report import write_report
from once.bench.replay.routing import ONCE_POLICY, StackRun, routed_runs, routing_section
from once.bench.replay.sessions import find_session, sample_names
from once.bench.replay.sglang_router import SGLANG_ROUTER_POLICY
from once.bench.replay.stacks import (
    APIS,
    NAIVE,
    ONCE,
    TINY,
    TOKENIZER_MODEL,
    load_served_runtime,
    make_tiny_replay_model,
    open_stack,
    stacks_for,
)
from once.bench.replay.traffic import progress_bars, replay_sessions
from once.bench.replay.vllm_baseline import (
    VLLM,
    check_vllm_baseline,
    check_vllm_length,
    run_vllm_column,
)
from once.bench.replay.vllm_pool import open_vllm_pool
from once.bench.replay.vs_peers import add_vs_peer, summary_lines
from once.router.policies import POLICIES

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
    parser.add_argument(
        "--api",
        choices=APIS,
        default=APIS[0],
        help="what the harness speaks: Responses over WebSocket (default) or HTTP, Chat "
        "Completions, or Anthropic Messages (once and naive both speak it)",
    )
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--max-calls", type=int, help="replay only the first N calls")
    parser.add_argument(
        "--kv-cache-gib", type=float, help="default: one request of --max-model-len, >= 0.25"
    )
    add_session_mode_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the JSON report")
    parser.add_argument(
        "--out", type=Path, help="also write report.json, report.md and plots here (a folder)"
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also replay the once stack with each optimization off in turn",
    )
    parser.add_argument(
        "--concurrency", type=int, default=1, help="sessions replayed at once on each stack"
    )
    parser.add_argument(
        "--pacing",
        choices=PACINGS,
        default=FAST,
        help="fast: next call at once; recorded: wait the recorded tool time (scaled)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies tool times")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--speculative",
        choices=["ngram", "suffix"],
        help="speculative decoding in the once stacks (naive never speculates); with "
        "--ablate, one more variant switches it off",
    )
    routing = parser.add_argument_group("routing (--replicas > 1)")
    routing.add_argument("--replicas", type=int, default=1, help="once engine processes")
    routing.add_argument("--slow-replicas", type=int, default=0, help="the last K are slow")
    routing.add_argument("--slowdown", type=float, default=2.0, help="slow replicas' factor")
    routing.add_argument(
        "--policies",
        nargs="+",
        default=[ONCE_POLICY],
        choices=sorted([*POLICIES, SGLANG_ROUTER_POLICY]),
        help="routing policies of the once stack (once, and the ones compared with it); "
        f"{SGLANG_ROUTER_POLICY}: SGLang's router in front (--engine vllm only)",
    )
    routing.add_argument("--replica-threads", type=int, help="default: cores // --replicas")
    routing.add_argument(
        "--engine",
        choices=["once", "vllm"],
        default="once",
        help="what the replicas are: once engine processes, or live vLLM servers",
    )
    routing.add_argument("--vllm-kv-mib", type=int, help="each vLLM server's KV cache (MiB)")
    add_kv_pressure_arguments(parser)
    add_pd_arguments(parser)
    return parser


def check_routing_args(args) -> str | None:
    """The problem with the routing flags, or None."""
    if args.replicas < 1:
        return "--replicas must be >= 1"
    if not 0 <= args.slow_replicas <= args.replicas:
        return "--slow-replicas must be between 0 and --replicas"
    if not args.slowdown >= 1.0:
        return "--slowdown must be >= 1.0"
    if ONCE_POLICY not in args.policies:
        return "--policies must include once (the stack the ledger reports)"
    if SGLANG_ROUTER_POLICY in args.policies and args.engine != "vllm":
        return f"--policies {SGLANG_ROUTER_POLICY} needs --engine vllm"
    if args.engine == "vllm":
        if args.slow_replicas:
            return "--slow-replicas needs --engine once (vLLM servers cannot be throttled)"
        if getattr(args, "pd", None) or getattr(args, "kv_blocks", None) is not None:
            return "--pd and --kv-blocks need --engine once"
        if args.vllm_kv_mib is not None and args.vllm_kv_mib < 1:
            return "--vllm-kv-mib must be >= 1"
    elif args.replicas == 1 and (args.slow_replicas or args.policies != [ONCE_POLICY]):
        return "--slow-replicas and --policies need --replicas > 1"
    if args.replica_threads is not None and args.replica_threads < 1:
        return "--replica-threads must be >= 1"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_model_len < 2 or (args.max_calls is not None and args.max_calls < 1):
        print("error: --max-model-len must be >= 2 and --max-calls >= 1", file=sys.stderr)
        return 2
    if args.concurrency < 1 or not args.time_scale >= 0:
        print("error: --concurrency must be >= 1 and --time-scale >= 0", file=sys.stderr)
        return 2
    problem = check_routing_args(args) or check_kv_pressure_args(args) or check_pd_args(args)
    problem = problem or check_vllm_baseline(args) or check_llamacpp_baseline(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        resolve_session_mode(args, TINY)
        check_vllm_length(args)
        names = args.sessions or sample_names()
        sessions = [find_session(name) for name in names]
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = asyncio.run(run_replay(sessions, args))
    if args.out:
        write_report(report, args.out)
        _log(f"report written to {args.out / 'report.md'}")
    if args.json:
        print(json.dumps(report, indent=2))
    elif report["sessions"]:
        print_summary(report)
        print_second_bar(report, sys.stdout)
        print(*summary_lines(report), sep="\n")
        if "kv_pressure" in report:
            print_kv_pressure(report["kv_pressure"], sys.stdout)
        if "pd" in report:
            print(format_pd_section(report["pd"]))
    print_failures(report, sys.stderr)
    broken = print_broken_checks(report, sys.stderr)
    return 1 if report.get("failures") or broken else 0


def print_broken_checks(report: dict, out) -> bool:
    """Say loudly where the ledger does not add up; True when it does not."""
    invariants = report.get("ledger_invariants") or {"holds": True}
    bound = report.get("shared_ideal") or {"holds": True}
    if not invariants["holds"]:
        print(
            f"LEDGER INVARIANT BROKEN on {invariants['num_violations']} of "
            f"{invariants['calls_checked']} calls:",
            *invariants["violations"],
            sep="\n  ",
            file=out,
        )
    if not bound["holds"]:
        print("SHARED-CACHE BOUND BEATEN (a count is wrong):", *bound["beaten"], sep="\n  ",
              file=out)  # fmt: skip
    return not invariants["holds"] or not bound["holds"]


async def run_replay(sessions, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="once-replay-") as tmp:
        if args.model == TINY:
            folder = make_tiny_replay_model(Path(tmp) / "tiny", args.max_model_len)
        else:
            from once.engine.loader import resolve_model_path

            folder = Path(resolve_model_path(args.model))
        runtime = load_served_runtime(folder, args.max_model_len)
        if getattr(args, "kv_cache_gib", None) is None:
            args.kv_cache_gib = kv_cache_gib_for(folder, args.max_model_len)
        if getattr(args, "max_output_tokens", 0):
            sessions = [(f, cut_outputs(s, runtime, args.max_output_tokens)) for f, s in sessions]
        plans = []
        for source_folder, session in sessions:
            plan = plan_session(
                session, runtime, max_calls=args.max_calls, max_model_len=args.max_model_len
            )
            if plan.calls:
                plans.append((source_folder, plan))
            else:
                _log(f"skip {session.session_id}: its first call does not fit")
        baseline, baselines = None, getattr(args, "baseline", None) or ()
        if "transformers" in baselines:  # first: its figures are logged early
            baseline = run_transformers_baseline(folder, [plan for _, plan in plans], _log)
        records: dict[str, dict[str, list[dict]]] = {}
        counters, traffic, routing_stats, pd_observed = {}, {}, {}, {}
        runs = stack_runs(args) + pressure_runs(args, str(Path(tmp) / "kv-disk"))
        pd = parse_pd(getattr(args, "pd", None))
        pd_stacks: list[StackRun] = []
        if pd is not None:
            threads = getattr(args, "replica_threads", None) or default_replica_threads(sum(pd))
            pd_stacks = pd_runs(args, threads)
            runs += pd_stacks
        async with contextlib.AsyncExitStack() as pools:
            if getattr(args, "engine", "once") == "vllm":
                pool = await pools.enter_async_context(open_pool(args, folder, Path(tmp)))
                runs = [with_pool(run, pool) for run in runs]
            with progress_bars(not getattr(args, "no_progress", True)) as progress:
                for run in runs:
                    name = run.spec.name
                    async with open_stack(
                        run.spec, runtime, folder, max_model_len=args.max_model_len,
                        kv_cache_gib=args.kv_cache_gib, **run.options,
                    ) as stack:  # fmt: skip
                        records[name], traffic[name] = await replay_sessions(
                            stack,
                            plans,
                            concurrency=getattr(args, "concurrency", 1),
                            pacing=getattr(args, "pacing", FAST),
                            time_scale=getattr(args, "time_scale", 1.0),
                            progress=progress,
                            log=None if progress is not None else _log,
                        )
                        counters[name] = await stack.counters()
                        if stack.fleet is not None:
                            routing_stats[name] = await stack.fleet.routing_stats()
                        if run in pd_stacks:
                            pd_observed[name] = await pd_observations(stack)
                        block_size = stack.block_size
        peer_columns: dict[str, dict] = {}  # once's stacks have closed: no sharing the cores
        if VLLM in baselines:
            peer_columns[VLLM] = await run_vllm_column(
                folder, plans, runtime, kv_cache_gib=args.kv_cache_gib,
                max_model_len=args.max_model_len, log=_log,
            )  # fmt: skip
        if LLAMACPP in baselines:
            peer_columns[LLAMACPP] = await run_llamacpp_column(
                folder, plans, runtime, max_model_len=args.max_model_len, log=_log
            )
    failures = collect(traffic)
    if failures:  # the ledger over the calls every stack completed (failures.py)
        measured = records
        counts = compared_calls(records, [plan.session_id for _, plan in plans])
        records = trim(records, counts)
        compared = [(folder, plan) for folder, plan in plans if counts[plan.session_id]]
        if not compared:
            return failed_report(args, list(counts), failures, counts, measured)
        plans = compared
    report = build_report(plans, records, counters, block_size, args)
    specs = {run.spec.name: run.spec for run in runs}
    report["ledger_invariants"] = ledger_invariants(
        records,
        {name: spec.prefix_caching for name, spec in specs.items()},
        {run.spec.name: bool(run.options.get("kv_tiers")) for run in runs},
        block_size,
    )
    add_cpu_seconds(report, traffic, STACKS)
    report.update(second_bar(records, baseline))
    report["max_output_tokens"] = getattr(args, "max_output_tokens", 0)
    for peer, column in peer_columns.items():
        add_vs_peer(report, peer, column)
    if getattr(args, "engine", "once") == "vllm":
        report["vllm_live"] = True
    if getattr(args, "api", APIS[0]) != APIS[0]:
        report["api"] = args.api
    ablations = [name for name in ABLATIONS if name in specs]
    add_ablation_and_traffic(report, plans, records, traffic, specs, block_size, args, ablations)
    if getattr(args, "replicas", 1) > 1 or getattr(args, "engine", "once") == "vllm":
        report["routing"] = routing_section(runs, records, routing_stats)
    if getattr(args, "kv_blocks", None) is not None:
        report["kv_pressure"] = kv_pressure_section(plans, records, counters, block_size, args)
    if pd_observed:
        report["pd"] = pd_section(records, pd_observed, args.pd, args.pd_transport)
        check_disaggregated_bound(report["shared_ideal"], disaggregated_work(report["pd"]))
    if failures:
        add_failures(report, failures, counts, measured)
    return report


def stack_runs(args) -> list[StackRun]:
    """once and naive (one engine each, or routed over replicas), then the ablations."""
    replicas = getattr(args, "replicas", 1)
    if replicas > 1 or getattr(args, "engine", "once") == "vllm":
        threads = getattr(args, "replica_threads", None) or default_replica_threads(replicas)
        runs = routed_runs(
            args.policies, replicas=replicas, slow_replicas=args.slow_replicas,
            slowdown=args.slowdown, threads=threads,
        )  # fmt: skip
        once_options = runs[0].options  # the once policy's stack comes first
    else:
        runs = [StackRun(spec) for spec in stacks_for(getattr(args, "api", APIS[0])).values()]
        once_options = {}
    if getattr(args, "ablate", False):
        runs += [
            StackRun(spec, once_options)
            for name, (spec, _) in ABLATIONS.items()
            if name != NO_SPECULATION or getattr(args, "speculative", None)
        ]
    method = getattr(args, "speculative", None)
    if method:  # every once stack speculates, but the naive one and the ablation of it
        keep = (NAIVE.name, NO_SPECULATION)
        runs = [
            run
            if run.spec.name in keep
            else replace(run, spec=replace(run.spec, speculative_method=method))
            for run in runs
        ]
    return runs


def open_pool(args, folder: Path, tmp: Path):
    """The live vLLM servers of `--engine vllm`, their logs in `tmp`."""
    mib = args.vllm_kv_mib or math.ceil(kv_cache_gib_for(folder, args.max_model_len) * 1024)
    return open_vllm_pool(
        folder,
        count=args.replicas,
        served_model=TOKENIZER_MODEL,
        threads=args.replica_threads or default_replica_threads(args.replicas),
        max_model_len=args.max_model_len,
        kv_cache_mib=mib,
        log_folder=tmp / "vllm",
    )


def with_pool(run: StackRun, pool) -> StackRun:
    """A routed stack over the pool's servers (the in-process reference stays as it is)."""
    if run.policy is None:
        return run
    return replace(run, options={**run.options, "vllm_pool": pool})


def add_ablation_and_traffic(
    report, plans, records, traffic, specs, block_size, args, variants
) -> None:
    """Extra sections, only when asked for: the default JSON keeps its shape."""
    if variants:
        totals = {"once": report["total"]["once"]}
        for name in variants:
            prefix_caching = specs[name].prefix_caching
            totals[name] = stack_totals(name, plans, records, block_size, prefix_caching)
        report["ablation_totals"] = {name: totals[name] for name in variants}
        report["ablation"] = ablation_table(totals)
    if getattr(args, "concurrency", 1) > 1 or getattr(args, "pacing", FAST) != FAST:
        report["traffic"] = {
            "concurrency": args.concurrency,
            "pacing": args.pacing,
            "time_scale": args.time_scale,
            "stack_wall_s": {name: t["stack_wall_s"] for name, t in traffic.items()},
            "tool_time_origins": traffic["once"]["origins"],
        }


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
    bound = shared_ideal(plans, records, prefill_elsewhere=(DISAGGREGATED, SHARED_KV))
    total_row = {**compare(total["once"], total["naive"]), **total}
    for folder, row in [*sources.items(), ("total", total_row)]:
        row["shared_ideal_tokens"] = bound["tokens"][folder]
        prompt = row["naive"]["prompt_tokens"]
        row["shared_ideal_ratio"] = round(bound["tokens"][folder] / prompt, 4) if prompt else None
    return {
        **run_description(args, TINY),
        "tokenizer": TOKENIZER_MODEL,
        "max_model_len": args.max_model_len,
        "calls_cut_by_context": sum(plan.num_cut_by_context for _, plan in plans),
        "block_size": block_size,
        "sessions": all_ids,
        "sources": sources,
        "total": total_row,
        "shared_ideal": bound,
        "unattributed_misses": unattributed,
        "per_session": ledgers,
        "counters": counters,
        "calls": records,
    }


def print_summary(report: dict, out=sys.stdout) -> None:
    print(
        f"once replay: {len(report['sessions'])} sessions, model {report['model']}, weights "
        f"{report.get('weights')}; context cap {report['max_model_len']} tokens "
        f"({report.get('calls_cut_by_context', 0)} recorded calls past it not replayed)",
        file=out,
    )
    header = (
        f"{'source folder':40} {'computed':>9} {'ideal':>7} {'shared':>7} {'bytes':>7} "
        f"{'tokenized':>9}"
    )
    print(header, file=out)
    for folder, row in {**report["sources"], "total": report["total"]}.items():
        shared = row.get("shared_ideal_ratio")
        print(
            f"{folder:40} {row['computed_ratio']:>9.3f} {row['ideal_ratio']:>7.3f} "
            f"{shared if shared is not None else float('nan'):>7.3f} "
            f"{row['bytes_ratio']:>7.3f} {row['tokenized_ratio']:>9.3f}",
            file=out,
        )
    for name in STACKS:
        total = report["total"][name]
        causes = ", ".join(f"{k} {v}" for k, v in total["miss_causes"].items())
        print(
            f"{name}: prompt {total['prompt_tokens']} tokens, computed {total['computed_tokens']}"
            f", cached {total['cached_tokens']}; TTFT p50 {total['ttft_p50_s']} s p95 "
            f"{total['ttft_p95_s']} s; wall {total['wall_s']} s\n  computed by cause: {causes}"
            f"\n  CPU s: {cpu_line(total.get('cpu_s'))}{_spec_line(total)}",
            file=out,
        )
    print(f"unattributed misses: {report['unattributed_misses']} tokens", file=out)
    routing = report.get("routing")
    if routing:
        print(
            f"routing over {routing['replicas']} replicas (slow: "
            f"{', '.join(routing['slow_replicas']) or 'none'}, x{routing['slowdown']}):",
            file=out,
        )
        for policy, row in routing["policies"].items():
            print(
                f"  {policy:18} cached {row['cached_tokens']:>9} computed "
                f"{row['computed_tokens']:>9} TTFT p50 {row['ttft_p50_s']} s p90 "
                f"{row['ttft_p90_s']} s retries {row['retries']} per replica "
                f"{row.get('requests_per_replica')}",
                file=out,
            )
        print(
            f"  cached vs single replica {routing['cached_ratio_vs_single']}; once p90 TTFT vs "
            f"session affinity {routing['p90_ttft_ratio_vs_session_affinity']}, vs round "
            f"robin {routing['p90_ttft_ratio_vs_round_robin']}; bar {routing['bar']}",
            file=out,
        )


def _spec_line(total: dict) -> str:
    if not total.get("num_drafts"):
        return ""
    return (
        f"\n  speculation: {total['num_drafts']} drafts, {total['num_accepted_tokens']} of "
        f"{total['num_draft_tokens']} drafted ids accepted, mean acceptance length "
        f"{total['mean_acceptance_length']}"
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
