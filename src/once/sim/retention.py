"""What a cache that cannot tell returning prefixes apart can reach: the trace's reuse gaps.

The unlimited shared cache (the hit-ratio bound) hits a request's leading blocks that were
seen before. For each such hit, the gap is the time since that block was last used. A
cache that keeps every block the same time T after its last use (LRU does; so, roughly,
does any policy with nothing online that predicts which conversations come back) catches
exactly the hits whose gap is at most T, so the curve "share of the bound's hit tokens with
gap <= T" is the ceiling of such a cache.

T follows from the capacity: with C blocks and r new distinct blocks a second, each block
stays about T = C / r (blocks held by running requests make it shorter). Inverting, the
capacity for a target share q is r times the gap at quantile q. `once sim --json` reports
both for its scenario (`retention` in the report), so a hit-ratio target can be checked
against the capacity before any policy is tried.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from once.sim.workload import SimRequest


def reuse_gaps(requests: Sequence[SimRequest], block_size: int) -> list[tuple[float, int]]:
    """(gap seconds, hit tokens) of every block the unlimited cache hits, tokens counted as
    `capacity.bound_cached_tokens` counts them (the prompt's last token is never cached)."""
    last_use: dict[int, float] = {}
    hits: list[tuple[float, int]] = []
    for request in sorted(requests, key=lambda r: r.arrival_s):
        now = request.arrival_s
        num_matched = 0
        for block_hash in request.block_hashes:
            if block_hash not in last_use:
                break
            num_matched += 1
        cached = min(num_matched * block_size, request.num_prompt_tokens - 1)
        for depth in range(num_matched):
            tokens = min(block_size, cached - depth * block_size)
            if tokens <= 0:
                break
            hits.append((now - last_use[request.block_hashes[depth]], tokens))
        for block_hash in request.block_hashes:
            last_use[block_hash] = now
    return hits


def retention_report(
    requests: Sequence[SimRequest], block_size: int, num_blocks: int, target: float = 0.9
) -> dict:
    """The uniform-retention ceiling for a cluster of `num_blocks` KV blocks in all."""
    if not requests or num_blocks < 1 or not 0 < target <= 1:
        raise ValueError("need requests, num_blocks >= 1 and 0 < target <= 1")
    hits = sorted(reuse_gaps(requests, block_size))
    arrivals = [r.arrival_s for r in requests]
    duration_s = max(arrivals) - min(arrivals)
    num_distinct = len({h for r in requests for h in r.block_hashes})
    new_blocks_per_s = num_distinct / duration_s if duration_s > 0 else float("inf")
    retention_s = num_blocks / new_blocks_per_s
    gaps = [gap for gap, _ in hits]
    cumulative, total = [], 0
    for _, tokens in hits:
        total += tokens
        cumulative.append(total)

    def share_within(seconds: float) -> float:
        index = bisect.bisect_right(gaps, seconds)
        return cumulative[index - 1] / total if index and total else 0.0

    index = bisect.bisect_left(cumulative, target * total) if total else 0
    gap_at_target = gaps[min(index, len(gaps) - 1)] if gaps else 0.0
    return {
        "new_blocks_per_s": new_blocks_per_s,
        "cluster_blocks": num_blocks,
        "retention_s": retention_s,
        "hit_share_within_retention": share_within(retention_s),
        "target": target,
        "gap_at_target_s": gap_at_target,
        "blocks_for_target": new_blocks_per_s * gap_at_target,
    }
