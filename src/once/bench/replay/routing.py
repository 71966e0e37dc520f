"""The stacks of a routed replay (`--replicas N > 1`) and the JSON's `routing` section.

With N replicas a replay runs, each on its own fresh set of replica processes (so every
stack's caches start empty):

    once                   the once stack behind the router with the `once` policy
    once/<policy>          the same with each other policy of `--policies`
    naive                  the naive stack, round-robin over the N replicas
    once/single            the once stack on one in-process engine: the reference that
                           cached tokens are compared with

The `routing` section puts the policies side by side: cached and computed prompt tokens,
client TTFT p50/p90, requests per replica, retries; and the three figures of the live bar:
`cached_ratio_vs_single` (once / single replica), `p90_ttft_ratio_vs_session_affinity`
and `p90_ttft_ratio_vs_round_robin` (once's p90 / theirs).

Over live vLLM servers (`--engine vllm`, vllm_pool.py) every policy runs on the same
servers, caches emptied between stacks, and the naive stack is round-robin with no
prefix reuse. Each policy then also has vLLM's own figures (`vllm`: prefix-cache queries
and hits, `hit_ratio`, prompt tokens computed) and the bar is vLLM's: once's hit ratio
>= 1.3 x round-robin's, its p90 TTFT <= 0.8 x round-robin's, and the prompt tokens vLLM
computed under once <= 1.02 x what once's own engine computes for the same calls
(`computed_ratio_vs_once_engine`, against `once/single`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from once.bench.replay.stacks import NAIVE, ONCE, StackSpec

ONCE_POLICY = "once"
SESSION_AFFINITY = "session_affinity"
ROUND_ROBIN = "round_robin"
SINGLE = "once/single"
# The live bar (issue 6): cached >= 0.9 x single, p90 <= 0.8 x affinity's and <= round robin's.
CACHED_VS_SINGLE_MIN = 0.9
P90_VS_AFFINITY_MAX = 0.8
P90_VS_ROUND_ROBIN_MAX = 1.0
# The vLLM bar (issue 28).
VLLM_HIT_RATIO_VS_ROUND_ROBIN_MIN = 1.3
VLLM_P90_VS_ROUND_ROBIN_MAX = 0.8
VLLM_COMPUTED_VS_ONCE_ENGINE_MAX = 1.02


@dataclass(frozen=True)
class StackRun:
    spec: StackSpec
    options: dict = field(default_factory=dict)  # open_stack's routing keywords
    policy: str | None = None  # None: not routed


def policy_stack_name(policy: str) -> str:
    return "once" if policy == ONCE_POLICY else f"once/{policy}"


def routed_runs(
    policies: list[str], *, replicas: int, slow_replicas: int, slowdown: float, threads: int
) -> list[StackRun]:
    """The stacks of a run with `replicas` > 1 (before any ablation), once's first."""
    policies = [ONCE_POLICY, *(p for p in dict.fromkeys(policies) if p != ONCE_POLICY)]
    fleet = dict(
        replicas=replicas, slow_replicas=slow_replicas, slowdown=slowdown, replica_threads=threads
    )
    runs = [
        StackRun(replace(ONCE, name=policy_stack_name(p)), {**fleet, "policy": p}, p)
        for p in policies
    ]
    runs.append(StackRun(NAIVE, {**fleet, "policy": ROUND_ROBIN}, ROUND_ROBIN))
    runs.append(StackRun(replace(ONCE, name=SINGLE)))
    return runs


def routing_figures(rows: list[dict], routing_stats: dict | None = None) -> dict:
    """One stack's figures from its call records (and its router's stats when routed)."""
    ttfts = [row["ttft_s"] for row in rows]
    codes = Counter(code for row in rows for code in row.get("error_codes", ()))
    figures = {
        "calls": len(rows),
        "prompt_tokens": sum(row["prompt_tokens"] for row in rows),
        "cached_tokens": sum(row["cached_tokens"] for row in rows),
        "computed_tokens": sum(row["computed_tokens"] for row in rows),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "retries": sum(row.get("retries", 0) for row in rows),
        "error_codes": dict(sorted(codes.items())),
    }
    if routing_stats is not None:
        calls = Counter(row.get("replica") for row in rows)
        figures["calls_per_replica"] = dict(sorted(calls.items()))  # after retries
        figures["requests_per_replica"] = routing_stats["requests_per_replica"]
        figures["measured_speed"] = routing_stats.get("measured_speed")
        figures["router"] = routing_stats["router"]
        if routing_stats.get("decisions"):
            figures["decisions"] = routing_stats["decisions"]
        if "vllm" in routing_stats:
            figures["vllm"] = routing_stats["vllm"]
            figures["hit_ratio"] = routing_stats["vllm"]["hit_ratio"]
    return figures


def routing_section(
    runs: list[StackRun],
    records: dict[str, dict[str, list[dict]]],
    routing_stats: dict[str, dict],
) -> dict:
    """records: stack name -> session id -> call records; routing_stats: stack name ->
    `Fleet.routing_stats()` of the routed stacks."""

    def rows_of(name: str) -> list[dict]:
        return [row for rows in records[name].values() for row in rows]

    policies = {}
    naive = None
    for run in runs:
        if run.policy is None:
            continue
        name = run.spec.name
        figures = {"stack": name, **routing_figures(rows_of(name), routing_stats.get(name))}
        if run.spec.prefix_caching:
            policies[run.policy] = figures
        else:
            naive = figures
    single = routing_figures(rows_of(SINGLE))
    once = policies[ONCE_POLICY]
    routed = next(run for run in runs if run.policy is not None)
    section = {
        "replicas": routed.options["replicas"],
        "slow_replicas": routing_stats.get(routed.spec.name, {}).get("slow_replicas", []),
        "slowdown": routed.options["slowdown"],
        "replica_threads": routed.options["replica_threads"],
        "policies": policies,
        "naive_round_robin": naive,
        "single_replica": single,
        "cached_ratio_vs_single": _ratio(once["cached_tokens"], single["cached_tokens"]),
        "p90_ttft_ratio_vs_session_affinity": _p90_ratio(policies, SESSION_AFFINITY),
        "p90_ttft_ratio_vs_round_robin": _p90_ratio(policies, ROUND_ROBIN),
    }
    if "vllm" in once:
        section["engine"] = "vllm"
        section["vllm_live"] = True
        round_robin = policies.get(ROUND_ROBIN, {})
        rr_hits = round_robin.get("hit_ratio")
        section["hit_ratio_vs_round_robin"] = (
            _ratio(once["hit_ratio"], rr_hits) if once["hit_ratio"] and rr_hits else None
        )
        section["computed_ratio_vs_once_engine"] = _ratio(
            once["vllm"]["computed_tokens"], single["computed_tokens"]
        )
        section["bar"] = _bar(section, VLLM_BAR)
    else:
        section["bar"] = _bar(section, LIVE_BAR)
    return section


# criterion -> (the section's figure, its bound, "min" or "max")
LIVE_BAR = {
    "cached_vs_single": ("cached_ratio_vs_single", CACHED_VS_SINGLE_MIN, "min"),
    "p90_vs_session_affinity": ("p90_ttft_ratio_vs_session_affinity", P90_VS_AFFINITY_MAX, "max"),
    "p90_vs_round_robin": ("p90_ttft_ratio_vs_round_robin", P90_VS_ROUND_ROBIN_MAX, "max"),
}
VLLM_BAR = {
    "hit_ratio_vs_round_robin": (
        "hit_ratio_vs_round_robin",
        VLLM_HIT_RATIO_VS_ROUND_ROBIN_MIN,
        "min",
    ),
    "p90_vs_round_robin": ("p90_ttft_ratio_vs_round_robin", VLLM_P90_VS_ROUND_ROBIN_MAX, "max"),
    "computed_vs_once_engine": (
        "computed_ratio_vs_once_engine",
        VLLM_COMPUTED_VS_ONCE_ENGINE_MAX,
        "max",
    ),
}


def _bar(section: dict, criteria: dict) -> dict:
    """Each criterion: True, False, or None when its figure was not measured."""
    verdicts = {}
    for name, (figure, bound, kind) in criteria.items():
        value = section[figure]
        ok = None if value is None else (value >= bound if kind == "min" else value <= bound)
        verdicts[name] = ok
    return verdicts


def _p90_ratio(policies: dict, baseline: str) -> float | None:
    if baseline not in policies:
        return None
    once, other = policies[ONCE_POLICY]["ttft_p90_s"], policies[baseline]["ttft_p90_s"]
    return None if once is None or other is None else _ratio(once, other)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None
