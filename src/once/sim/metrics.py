"""What a simulated run reports: cache hits, latency percentiles, goodput, balance."""

from __future__ import annotations

from collections.abc import Sequence

from once.sim.capacity import bound_cached_tokens
from once.sim.cluster import SimResult
from once.sim.latency import LatencyHistogram
from once.sim.replica import RequestState
from once.sim.workload import SimRequest


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    result: SimResult,
    requests: Sequence[SimRequest],
    *,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> dict:
    states = result.states
    served = [s for s in states if not s.rejected and s.finish_s is not None]
    num_prompt = sum(s.request.num_prompt_tokens for s in served)
    num_cached = sum(s.num_cached_tokens for s in served)
    num_device_cached = sum(s.num_device_cached_tokens for s in served)
    pairs = latencies(served)
    ttfts = [ttft for ttft, _ in pairs]
    # of the requests with more than one output token
    tpots = [
        tpot for s, (_, tpot) in zip(served, pairs, strict=True) if s.request.num_output_tokens > 1
    ]
    good = sum(ttft <= ttft_slo_s and tpot <= tpot_slo_s for ttft, tpot in pairs)
    first_arrival = min((s.arrival_s for s in states), default=0.0)
    duration_s = max(result.end_s - first_arrival, 1e-9)
    busy = [replica.busy_s for replica in result.replicas]
    mean_busy = sum(busy) / len(busy)
    block_size = result.replicas[0].profile.block_size
    itl = LatencyHistogram().merge(replica.itl for replica in result.replicas)
    bound = bound_cached_tokens(requests, block_size)
    num_bound_prompt = sum(r.num_prompt_tokens for r in requests)
    return {
        "num_requests": len(states),
        "num_rejected": len(states) - len(served),
        # Tokens not recomputed: device hits and, with tiers, blocks loaded from them.
        "hit_ratio": num_cached / num_prompt if num_prompt else 0.0,
        "device_hit_ratio": num_device_cached / num_prompt if num_prompt else 0.0,
        "hit_ratio_bound": sum(bound) / num_bound_prompt if num_bound_prompt else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_mean_s": sum(tpots) / len(tpots) if tpots else float("nan"),
        "tpot_p90_s": percentile(tpots, 90),
        # Over every output token after the first (`once.sim.latency`).
        "itl_p50_s": itl.percentile(50),
        "itl_p90_s": itl.percentile(90),
        "itl_p99_s": itl.percentile(99),
        "slo_attainment": good / len(states) if states else 0.0,
        "goodput_rps": good / duration_s,
        # max / mean busy time of the replicas: 1.0 is perfect balance
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
        "prefilled_tokens": sum(replica.num_prefilled_tokens for replica in result.replicas),
        "kv_evictions": sum(replica.cache.num_evictions for replica in result.replicas),
        "duration_s": duration_s,
        **tier_report(result),
        **({"pd": result.pd} if result.pd else {}),
    }


def latencies(served: Sequence[RequestState]) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of each finished request; TPOT 0 for a single output token."""
    pairs = []
    for state in served:
        first_token_s, finish_s = state.first_token_s, state.finish_s
        assert first_token_s is not None and finish_s is not None  # admitted and finished
        tokens = state.request.num_output_tokens
        tpot = (finish_s - first_token_s) / (tokens - 1) if tokens > 1 else 0.0
        pairs.append((first_token_s - state.arrival_s, tpot))
    return pairs


def tier_report(result: SimResult) -> dict:
    """Per lower tier, summed over the replicas: what it supplied and what that cost.
    Empty without tiers, so a run without them reports what it did before tiers existed."""
    totals: dict[str, dict] = {}
    for replica in result.replicas:
        for store in replica.tiers.stores if replica.tiers is not None else ():
            stats = store.stats
            row = totals.setdefault(
                store.name,
                {
                    "capacity_blocks_per_replica": store.capacity,
                    "hit_blocks": 0,
                    "hit_tokens": 0,
                    "loaded_bytes": 0,
                    "load_s": 0.0,
                    "num_loads": 0,
                    "written_blocks": 0,
                    "evictions": 0,
                },
            )
            row["hit_blocks"] += stats.num_hit_blocks
            row["hit_tokens"] += stats.num_hit_tokens
            row["loaded_bytes"] += stats.num_loaded_bytes
            row["load_s"] += stats.load_s
            row["num_loads"] += stats.num_loads
            row["written_blocks"] += stats.num_writes
            row["evictions"] += stats.num_evictions
    for row in totals.values():
        row["mean_load_s"] = row["load_s"] / row["num_loads"] if row["num_loads"] else 0.0
    return {"tiers": totals} if totals else {}
