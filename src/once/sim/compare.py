"""Every routing policy on the same trace at the same offered load, and the bar's ratios.

With KV tiers below the device pools, once also runs the same scenario without them, so the
report shows what the tiers change for it in the same invocation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from once.kv_eviction.policies import DEFAULT_EVICTION
from once.router.policies import POLICIES, make_policy
from once.sim.capacity import arrival_scale_for_load, shared_lru_hit_ratio
from once.sim.cluster import Cluster, SimResult
from once.sim.disagg.transfer import PDConfig
from once.sim.metrics import summarize
from once.sim.profiles import ReplicaProfile
from once.sim.retention import retention_report
from once.sim.tiers import TierConfig
from once.sim.workload import SimRequest, scale_arrivals

ONCE_POLICY = "once"
DEFAULT_POLICIES = tuple(POLICIES)  # once and the six baselines, each at its own defaults


@dataclass(frozen=True)
class Scenario:
    profile: ReplicaProfile
    num_replicas: int = 8
    load: float = 0.8
    seed: int = 0
    eviction: str = DEFAULT_EVICTION
    tiers: TierConfig = field(default_factory=TierConfig)


def run_policy(requests: Sequence[SimRequest], scenario: Scenario, policy_name: str) -> dict:
    _, row = run_cluster(requests, scenario, policy_name)
    return {"policy": policy_name, **row}


def run_cluster(
    requests: Sequence[SimRequest], scenario: Scenario, policy_name: str, pd: PDConfig | None = None
) -> tuple[SimResult, dict]:
    """The scenario's cluster under `policy_name` (disaggregated with `pd`): its result
    and the summary at the profile's SLOs."""
    profile = scenario.profile
    cluster = Cluster(
        [profile] * scenario.num_replicas,
        make_policy(policy_name),
        seed=scenario.seed,
        eviction=scenario.eviction,
        tiers=scenario.tiers,
        pd=pd,
    )
    result = cluster.run(requests)
    row = summarize(result, requests, ttft_slo_s=profile.ttft_slo_s, tpot_slo_s=profile.tpot_slo_s)
    return result, row


def compare_policies(
    requests: Sequence[SimRequest], scenario: Scenario, policy_names: Sequence[str]
) -> dict:
    if not requests:
        raise ValueError("the trace has no requests")
    unknown = [name for name in policy_names if name not in POLICIES]
    if unknown:
        raise ValueError(f"unknown routing policies {unknown}; choose from {sorted(POLICIES)}")
    scale = arrival_scale_for_load(requests, scenario.profile, scenario.num_replicas, scenario.load)
    scaled = scale_arrivals(list(requests), scale)
    table = [run_policy(scaled, scenario, name) for name in policy_names]
    report = {
        "profile": scenario.profile.name,
        "num_replicas": scenario.num_replicas,
        "offered_load": scenario.load,
        "arrival_scale": scale,
        "kv_blocks_per_replica": scenario.profile.kv_blocks,
        "eviction": scenario.eviction,
        "block_size": scenario.profile.block_size,
        "ttft_slo_s": scenario.profile.ttft_slo_s,
        "tpot_slo_s": scenario.profile.tpot_slo_s,
        "hit_ratio_bound": table[0]["hit_ratio_bound"],
        "hit_ratio_shared_lru": shared_lru_hit_ratio(
            scaled, scenario.profile.block_size, scenario.profile.kv_blocks * scenario.num_replicas
        ),
        # The ceiling of a cache that keeps every block alike, at this cluster's capacity.
        "retention": retention_report(
            scaled, scenario.profile.block_size, scenario.profile.kv_blocks * scenario.num_replicas
        ),
        "policies": table,
    }
    report.update(bar_ratios(table))
    if scenario.tiers.enabled and ONCE_POLICY in policy_names:
        report.update(tier_comparison(scaled, scenario, table))
    return report


def tier_comparison(
    requests: Sequence[SimRequest], scenario: Scenario, table: Sequence[dict]
) -> dict:
    """once with the scenario's tiers (from `table`) against once without any."""
    tiers = scenario.tiers
    with_tiers = next(row for row in table if row["policy"] == ONCE_POLICY)
    without = run_policy(requests, replace(scenario, tiers=TierConfig()), ONCE_POLICY)
    return {
        "host_tier_ratio": tiers.host_ratio,
        "disk_tier_ratio": tiers.disk_ratio,
        "host_eviction": tiers.host_eviction,
        "disk_eviction": tiers.disk_eviction,
        "kv_block_bytes": scenario.profile.kv_block_bytes,
        "ttft_p90_s_no_tiers": without["ttft_p90_s"],
        "ttft_p90_s_tiers": with_tiers["ttft_p90_s"],
        "tier_ttft_p90_ratio": ratio(with_tiers["ttft_p90_s"], without["ttft_p90_s"]),
        "hit_ratio_no_tiers": without["hit_ratio"],
        "hit_ratio_vs_bound_no_tiers": ratio(without["hit_ratio"], without["hit_ratio_bound"]),
        "once_no_tiers": without,
    }


def bar_ratios(table: Sequence[dict]) -> dict:
    """once against the best of the others: p90 TTFT (lower is better: the lowest other),
    goodput (the highest other); and once's hit ratio against the unlimited-cache bound,
    reported even when once runs alone."""
    once = next((row for row in table if row["policy"] == ONCE_POLICY), None)
    if once is None:
        return {}
    ratios = {"hit_ratio_vs_bound": ratio(once["hit_ratio"], once["hit_ratio_bound"])}
    others = [row for row in table if row["policy"] != ONCE_POLICY]
    if not others:
        return ratios
    best_ttft = min(others, key=lambda row: row["ttft_p90_s"])
    best_goodput = max(others, key=lambda row: row["goodput_rps"])
    return {
        "best_other_p90_ttft_policy": best_ttft["policy"],
        "p90_ttft_ratio_vs_best": ratio(once["ttft_p90_s"], best_ttft["ttft_p90_s"]),
        "best_other_goodput_policy": best_goodput["policy"],
        "goodput_ratio_vs_best": ratio(once["goodput_rps"], best_goodput["goodput_rps"]),
        **ratios,
    }


def ratio(a: float, b: float) -> float:
    if b == 0 or math.isnan(a) or math.isnan(b):
        return float("nan")
    return a / b
