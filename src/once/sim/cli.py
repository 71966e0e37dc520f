"""`once sim`: replay a trace on a simulated cluster and compare routing policies.

    once sim [--trace mooncake|agents] [--replicas 8] [--load 0.8] [--policies ...] [--json]
             [--host-tier-ratio R [--disk-tier-ratio R]]
    once sim --pd [--pd-prefill P ...] [--pd-threshold N ...] [--pd-decode-budget N ...]

The defaults measure the issue's first bar: the first 30 minutes of the Mooncake
conversation trace, 8 replicas of the H200 profile, offered load 80% of capacity, every
policy at its own published defaults. `--host-tier-ratio` adds a host-memory KV tier of R
times the device pool below each replica (and `--disk-tier-ratio` a disk tier below it);
once then also runs without tiers, and the report gives both p90 TTFTs. `--pd` compares
prefill/decode disaggregation with colocated serving instead (`once.sim.disagg.compare`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from once.kv_eviction.policies import DEFAULT_EVICTION, EVICTION_POLICIES
from once.sim.compare import DEFAULT_POLICIES, Scenario, compare_policies
from once.sim.disagg.compare import (
    DEFAULT_DECODE_BUDGETS,
    DEFAULT_THRESHOLDS,
    TIGHT_TPOT_SLO_S,
    PDGrid,
    compare_pd,
    format_pd_report,
)
from once.sim.profiles import DEFAULT_PROFILE, load_profiles
from once.sim.tiers import TierConfig
from once.sim.workload import load_agent_sessions, load_mooncake

_COLUMNS = (
    ("policy", "policy", "{}"),
    ("hit", "hit_ratio", "{:.3f}"),
    ("ttft p50", "ttft_p50_s", "{:.2f}"),
    ("p90", "ttft_p90_s", "{:.2f}"),
    ("p99", "ttft_p99_s", "{:.2f}"),
    ("tpot ms", "tpot_mean_s", "{:.1f}"),
    ("slo ok", "slo_attainment", "{:.3f}"),
    ("goodput/s", "goodput_rps", "{:.2f}"),
    ("imbalance", "load_imbalance", "{:.3f}"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="once sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=("mooncake", "agents"), default="mooncake")
    parser.add_argument("--trace-path", help="a Mooncake JSONL file or an agent_traces folder")
    parser.add_argument("--minutes", type=float, default=30.0, help="Mooncake: first N minutes")
    parser.add_argument("--limit", type=int, help="at most this many requests (or sessions)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.8, help="offered load, 0..1 of capacity")
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--kv-blocks", type=int, help="override the profile's KV blocks")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default=DEFAULT_EVICTION,
        help="KV eviction on every replica (belady sees the future: a reference bound only)",
    )
    parser.add_argument(
        "--host-tier-ratio",
        type=float,
        default=0.0,
        help="host-memory KV tier per replica, in device pools (0: none)",
    )
    parser.add_argument(
        "--disk-tier-ratio",
        type=float,
        default=0.0,
        help="local-disk KV tier below the host tier, in device pools (0: none)",
    )
    parser.add_argument("--host-eviction", choices=EVICTION_POLICIES, default="lru")
    parser.add_argument("--disk-eviction", choices=EVICTION_POLICIES, default="lru")
    parser.add_argument(
        "--pd", action="store_true", help="disaggregated P:D pools against colocated (once policy)"
    )
    parser.add_argument(
        "--pd-prefill", type=int, nargs="+", default=[], help="prefill replica counts to try"
    )
    parser.add_argument(
        "--pd-threshold", type=int, nargs="+", default=list(DEFAULT_THRESHOLDS),
        help="split only prompts with at least this many uncached tokens",
    )  # fmt: skip
    parser.add_argument(
        "--pd-decode-budget", type=int, nargs="+", default=list(DEFAULT_DECODE_BUDGETS),
        help="decode replicas' tokens per step (0: the profile's)",
    )  # fmt: skip
    parser.add_argument("--pd-tight-tpot-ms", type=float, default=TIGHT_TPOT_SLO_S * 1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except (ValueError, OSError) as exc:
        print(f"once sim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_finite(report), indent=2, allow_nan=False))
    elif args.pd:
        print(format_pd_report(report))
    else:
        print(format_report(report))
    return 0


def run(args: argparse.Namespace) -> dict:
    profiles = load_profiles()
    if args.profile not in profiles:
        raise ValueError(f"unknown profile {args.profile!r}; choose one of {sorted(profiles)}")
    profile = profiles[args.profile]
    if args.kv_blocks is not None:
        profile = profile.with_overrides(kv_blocks=args.kv_blocks)
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if not 0 < args.load:
        raise ValueError("--load must be > 0")
    if args.trace == "mooncake":
        if profile.block_size != 512:
            raise ValueError("the Mooncake trace's hash_ids are 512-token blocks")
        requests = load_mooncake(args.trace_path, minutes=args.minutes, limit=args.limit)
    else:
        requests = load_agent_sessions(
            args.trace_path, limit=args.limit, block_size=profile.block_size
        )
    tiers = TierConfig(
        args.host_tier_ratio, args.disk_tier_ratio, args.host_eviction, args.disk_eviction
    )
    scenario = Scenario(profile, args.replicas, args.load, args.seed, args.eviction, tiers)
    if args.pd:
        if any(n < 1 for n in args.pd_threshold) or any(n < 0 for n in args.pd_decode_budget):
            raise ValueError("--pd-threshold must be >= 1 and --pd-decode-budget >= 0")
        if not args.pd_tight_tpot_ms > 0:
            raise ValueError("--pd-tight-tpot-ms must be > 0")
        grid = PDGrid(
            tuple(args.pd_prefill),
            tuple(args.pd_threshold),
            tuple(args.pd_decode_budget),
            args.pd_tight_tpot_ms / 1000,
        )
        report = compare_pd(requests, scenario, grid)
        report["trace"] = args.trace
        return report
    report = compare_policies(requests, scenario, args.policies)
    report["trace"] = args.trace
    return report


def format_report(report: dict) -> str:
    lines = [
        f"{report['trace']} on {report['num_replicas']} x {report['profile']} "
        f"({report['kv_blocks_per_replica']} KV blocks of {report['block_size']}, "
        f"{report['eviction']} eviction), "
        f"offered load {report['offered_load']:.2f}, SLO TTFT <= {report['ttft_slo_s']} s "
        f"and TPOT <= {report['tpot_slo_s'] * 1000:.0f} ms; unlimited-cache hit bound "
        f"{report['hit_ratio_bound']:.3f}",
        "  ".join(f"{title:>10}" for title, _, _ in _COLUMNS),
    ]
    for row in report["policies"]:
        cells = []
        for _, key, fmt in _COLUMNS:
            value = row[key] * 1000 if key == "tpot_mean_s" else row[key]
            cells.append(f"{fmt.format(value):>10}")
        lines.append("  ".join(cells))
    if "p90_ttft_ratio_vs_best" in report:
        lines.append(
            f"once vs best other: p90 TTFT {report['p90_ttft_ratio_vs_best']:.3f}x "
            f"({report['best_other_p90_ttft_policy']}), goodput "
            f"{report['goodput_ratio_vs_best']:.3f}x ({report['best_other_goodput_policy']}); "
            f"hit ratio {report['hit_ratio_vs_bound']:.3f} of the bound"
        )
    if "tier_ttft_p90_ratio" in report:
        tier_rows = report["policies"][[r["policy"] for r in report["policies"]].index("once")]
        supplied = ", ".join(
            f"{name} {row['hit_tokens'] / 1e6:.1f}M tokens ({row['loaded_bytes'] / 1e12:.1f} TB, "
            f"{row['mean_load_s'] * 1000:.1f} ms a load)"
            for name, row in tier_rows.get("tiers", {}).items()
        )
        lines.append(
            f"tiers (host {report['host_tier_ratio']:g}x, disk {report['disk_tier_ratio']:g}x "
            f"the device pool): once's p90 TTFT {report['ttft_p90_s_tiers']:.2f} s vs "
            f"{report['ttft_p90_s_no_tiers']:.2f} s without, "
            f"{report['tier_ttft_p90_ratio']:.3f}x; hit ratio {tier_rows['hit_ratio']:.3f} "
            f"(device {tier_rows['device_hit_ratio']:.3f}); loaded: {supplied}"
        )
    retention = report.get("retention")
    if retention:
        lines.append(
            f"uniform retention: {retention['cluster_blocks']} blocks keep a block "
            f"{retention['retention_s']:.0f} s, which catches "
            f"{retention['hit_share_within_retention']:.3f} of the bound's hit tokens; "
            f"{retention['target']:.2f} needs ~{retention['blocks_for_target']:.0f} blocks"
        )
    return "\n".join(lines)


def _finite(value: object) -> object:
    # NaN (no request to take a percentile of) is not JSON: it becomes null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
