"""`once replay --kv-blocks N`: the once stack again on a small device KV pool, without
and with the KV tiers below it, in the same run.

    once              the default pool (one request of --max-model-len, or more)
    once-kv-pressure  a device pool of N blocks, no tiers: what eviction costs
    once-kv-tiers     the same N blocks, over a host tier (--kv-host-blocks, default
                      4 N) and a disk tier in a temporary folder (--kv-disk-gib)

Eviction shows when sessions run side by side (--concurrency) or pause (--pacing
recorded): with one session at a time the pool only has to hold that session. The
section `kv_pressure` gives, per variant, the prompt tokens the ledger attributes to
`evicted` (`tier_miss` with tiers), what was computed again for any cause (ledger.py's
PAID_TWICE: eviction, tier miss, preemption, ...), what was computed in all, TTFT
percentiles and the engine's per-tier figures, and the bar's ratio: tokens computed
again with tiers / without (`recompute_ratio_tiers_vs_none`; `evicted_ratio_tiers_vs_none`
counts eviction alone). The pool's size in tokens is set beside the context cap: a call
longer than the pool (`calls_over_pool`) cannot keep its own prefix. Outputs are the recorded ones
forced (forced.py), so "identical outputs" here means every call ran to its recorded
output; that K/V loaded from a tier gives the logits of recomputing it is the engine's
own test (tests/engine/test_kv_tiers.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from once.bench.replay.ledger import (
    EVICTED,
    PREEMPTED,
    TIER_MISS,
    UNATTRIBUTED,
    merge,
    paid_twice,
    session_ledger,
)
from once.bench.replay.pacing import RECORDED
from once.bench.replay.routing import StackRun
from once.bench.replay.stacks import ONCE

PRESSURE = "once-kv-pressure"
TIERS = "once-kv-tiers"
HINTS = "once-kv-hints"
VARIANTS = (PRESSURE, TIERS)
ENGINE_FIGURES = ("kv_tier_", "kv_pause_")  # engine stats copied into the section


def add_kv_pressure_arguments(parser) -> None:
    group = parser.add_argument_group("KV pressure (--kv-blocks)")
    group.add_argument(
        "--kv-blocks", type=int, help="also replay once on a device pool of N blocks, "
        "without and with KV tiers (" + ", ".join(VARIANTS) + ")",
    )  # fmt: skip
    group.add_argument("--kv-host-blocks", type=int, help="host tier slots (default 4 N)")
    group.add_argument("--kv-disk-gib", type=float, default=1.0, help="disk tier's bound")
    group.add_argument(
        "--kv-offload", choices=("write_through", "write_back"), default="write_through"
    )
    group.add_argument(
        "--kv-hints", action="store_true", help=f"also {HINTS}: {TIERS} with the client's "
        "tool pause hints (needs --pacing recorded)",
    )  # fmt: skip
    group.add_argument(
        "--kv-host-tier-only", action="store_true", help="no disk tier under the host tier"
    )


def check_kv_pressure_args(args) -> str | None:
    blocks = getattr(args, "kv_blocks", None)
    if blocks is None:
        return None
    if blocks < 1 or (args.kv_host_blocks is not None and args.kv_host_blocks < 1):
        return "--kv-blocks and --kv-host-blocks must be >= 1"
    if getattr(args, "replicas", 1) > 1:
        return "--kv-blocks replays one in-process engine: it does not take --replicas"
    if getattr(args, "kv_hints", False) and getattr(args, "pacing", None) != RECORDED:
        return "--kv-hints needs --pacing recorded: a hint is about the pause after a call"
    return None


def pressure_runs(args, disk_folder: str) -> list[StackRun]:
    blocks = getattr(args, "kv_blocks", None)
    if blocks is None:
        return []
    tiers = {
        "kv_host_blocks": args.kv_host_blocks or 4 * blocks,
        "kv_offload": args.kv_offload,
    }
    if not getattr(args, "kv_host_tier_only", False):
        tiers |= {"kv_disk_path": disk_folder, "kv_disk_gib": args.kv_disk_gib}
    runs = [
        StackRun(replace(ONCE, name=PRESSURE), {"num_kv_blocks": blocks}),
        StackRun(replace(ONCE, name=TIERS), {"num_kv_blocks": blocks, "kv_tiers": tiers}),
    ]
    if getattr(args, "kv_hints", False):
        # Its own disk folder: the disk tier outlives an engine, and must start empty.
        hinted_tiers = {**tiers, "kv_pause_hints": True}
        if "kv_disk_path" in tiers:
            hinted_tiers["kv_disk_path"] = disk_folder + "-hints"
        options = {"num_kv_blocks": blocks, "kv_tiers": hinted_tiers}
        runs.append(StackRun(replace(ONCE, name=HINTS, pause_hints=True), options))
    return runs


def variant_names(args) -> tuple[str, ...]:
    return (*VARIANTS, HINTS) if getattr(args, "kv_hints", False) else VARIANTS


def stack_totals(
    name: str, plans, records, block_size: int, prefix_caching: bool, tiers: bool = False
) -> dict:
    """One stack's ledger merged over every planned session."""
    ledgers = [
        session_ledger(
            records[name][plan.session_id],
            block_size=block_size,
            prefix_caching=prefix_caching,
            tiers=tiers,
        )
        for _, plan in plans
    ]
    rows = [row for _, plan in plans for row in records[name][plan.session_id]]
    return merge(ledgers, rows)


def kv_pressure_section(plans, records, counters, block_size: int, args) -> dict:
    pool_tokens = args.kv_blocks * block_size
    section: dict = {
        "kv_blocks": args.kv_blocks,
        "kv_pool_tokens": pool_tokens,
        "context_cap": getattr(args, "max_model_len", None),
        "calls_over_pool": sum(
            1
            for _, plan in plans
            for call in plan.calls
            if len(call.prompt_ids) + len(call.forced_ids) > pool_tokens
        ),  # fmt: skip
        "variants": {},
    }
    for name in ("once", *variant_names(args)):
        tiers = name in (TIERS, HINTS)
        totals = stack_totals(name, plans, records, block_size, True, tiers=tiers)
        engine = counters[name]["engine"]
        causes = totals["miss_causes"]
        section["variants"][name] = {
            "evicted_tokens": causes.get(EVICTED, 0) + causes.get(TIER_MISS, 0),
            "preempted_tokens": causes.get(PREEMPTED, 0),
            "unattributed_tokens": causes.get(UNATTRIBUTED, 0),
            "recomputed_tokens": paid_twice(causes),
            "computed_tokens": totals["computed_tokens"],
            "cached_tokens": totals["cached_tokens"],
            "tier_cached_tokens": totals["tier_cached_tokens"],
            "prompt_tokens": totals["prompt_tokens"],
            "miss_causes": causes,
            "outputs_not_as_recorded": totals["outputs_not_as_recorded"],
            "ttft_p50_s": totals["ttft_p50_s"],
            "ttft_p95_s": totals["ttft_p95_s"],
            "wall_s": totals["wall_s"],
            "ttft_after_pause_p90_s": after_pause_ttft_p90(records[name]),
            # What the TTFT swings around, steady from run to run: the work after pauses.
            "computed_tokens_after_pause": sum(
                row["computed_tokens"] for rows in records[name].values() for row in rows[1:]
            ),
            "num_kv_evictions": engine["num_kv_evictions"],
            "num_kv_keeps_broken": engine.get("num_kv_keeps_broken", 0),
            **{key: value for key, value in engine.items() if key.startswith(ENGINE_FIGURES)},
        }
    for figure, ratio in (
        ("evicted_tokens", "evicted_ratio_tiers_vs_none"),
        ("recomputed_tokens", "recompute_ratio_tiers_vs_none"),
    ):
        without, with_tiers = (section["variants"][name][figure] for name in VARIANTS)
        section[ratio] = round(with_tiers / without, 4) if without else None
    if HINTS in section["variants"]:
        variants = section["variants"]
        for ratio, figure in (
            ("after_pause_ttft_p90_ratio_hints_vs_none", "ttft_after_pause_p90_s"),
            ("after_pause_computed_ratio_hints_vs_none", "computed_tokens_after_pause"),
        ):
            hinted, unhinted = variants[HINTS][figure], variants[TIERS][figure]
            section[ratio] = round(hinted / unhinted, 4) if unhinted else None
    section["outputs_identical"] = all(
        v["outputs_not_as_recorded"] == 0 for v in section["variants"].values()
    )
    return section


def after_pause_ttft_p90(records_by_session: dict[str, list[dict]]) -> float | None:
    """p90 client TTFT of the calls that follow a tool pause (all but each first call)."""
    ttfts = [row["ttft_s"] for rows in records_by_session.values() for row in rows[1:]]
    return round(float(np.percentile(ttfts, 90)), 4) if ttfts else None


def print_kv_pressure(section: dict, out) -> None:
    print(
        f"\nKV pressure: device pool of {section['kv_blocks']} blocks "
        f"({section['kv_pool_tokens']} tokens; context cap {section['context_cap']}, "
        f"{section['calls_over_pool']} calls longer than the pool)",
        file=out,
    )
    print(
        f"{'stack':<18} {'evicted':>9} {'preempted':>9} {'again':>9} {'computed':>10} "
        f"{'ttft p95':>9}",
        file=out,
    )
    for name, figures in section["variants"].items():
        print(
            f"{name:<18} {figures['evicted_tokens']:>9} {figures['preempted_tokens']:>9} "
            f"{figures['recomputed_tokens']:>9} {figures['computed_tokens']:>10} "
            f"{figures['ttft_p95_s'] or 0:>9.3f}",
            file=out,
        )
    print(
        f"tokens computed again (every cause), tiers / none: "
        f"{section['recompute_ratio_tiers_vs_none']} (bar <= 0.2; eviction alone "
        f"{section['evicted_ratio_tiers_vs_none']}); outputs identical: "
        f"{section['outputs_identical']}",
        file=out,
    )
    ratio = section.get("after_pause_ttft_p90_ratio_hints_vs_none")
    if ratio is not None:
        print(f"p90 TTFT after a tool pause, hints / none: {ratio} (bar <= 0.6)", file=out)
