"""Offered load: how much work a trace brings, and the arrival scale for a target load.

The capacity of a replica is measured against the work no cluster can avoid: each request's
prefill of the tokens one unlimited shared cache would not have (the hit-ratio bound), with
its attention over the cached context, plus its decode at the profile's marginal cost per
sequence, with the step base shared by a reference batch of REFERENCE_BATCH sequences (and
by a full token budget for prefill). Offered load = work per second / number of replicas, so
load 0.8 means a cluster with a perfect shared cache would be busy 80% of the time; a policy
that loses cache hits works more than that at the same offered load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from once.sim.profiles import ReplicaProfile
from once.sim.workload import SimRequest

REFERENCE_BATCH = 32


def bound_cached_tokens(requests: Sequence[SimRequest], block_size: int) -> list[int]:
    """Cached prompt tokens of each request under one unlimited cache shared by all replicas,
    in arrival order (a request's blocks are cached once it has arrived)."""
    seen: set[int] = set()
    cached = []
    for request in sorted(requests, key=lambda r: r.arrival_s):
        num_matched = 0
        for block_hash in request.block_hashes:
            if block_hash not in seen:
                break
            num_matched += 1
        cached.append(min(num_matched * block_size, request.num_prompt_tokens - 1))
        seen.update(request.block_hashes)
    return cached


def shared_lru_hit_ratio(requests: Sequence[SimRequest], block_size: int, capacity: int) -> float:
    """Token-weighted hit ratio of one LRU cache of `capacity` blocks shared by all replicas
    (blocks cached at arrival, never pinned): what the cluster's total KV could keep if it
    were one cache, a reference between the unlimited bound and the routed replicas."""
    lru: OrderedDict[int, None] = OrderedDict()
    num_cached = num_prompt = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        num_matched = 0
        for block_hash in request.block_hashes:
            if block_hash not in lru:
                break
            num_matched += 1
        num_cached += min(num_matched * block_size, request.num_prompt_tokens - 1)
        num_prompt += request.num_prompt_tokens
        for block_hash in request.block_hashes:
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return num_cached / num_prompt if num_prompt else 0.0


def request_work_s(request: SimRequest, num_cached: int, profile: ReplicaProfile) -> float:
    num_new = request.num_prompt_tokens - num_cached
    prefill_s = profile.prefill_s(num_new, num_cached)
    prefill_s += profile.step_base_s * num_new / profile.max_num_batched_tokens
    context = request.num_prompt_tokens + request.num_output_tokens // 2
    decode_per_token_s = profile.decode_s(1, context) + profile.step_base_s / REFERENCE_BATCH
    return prefill_s + (request.num_output_tokens - 1) * decode_per_token_s


def total_work_s(requests: Sequence[SimRequest], profile: ReplicaProfile) -> float:
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    cached = bound_cached_tokens(ordered, profile.block_size)
    return sum(request_work_s(r, c, profile) for r, c in zip(ordered, cached, strict=True))


def arrival_scale_for_load(
    requests: Sequence[SimRequest], profile: ReplicaProfile, num_replicas: int, load: float
) -> float:
    """Factor to multiply open-loop arrival times by so the offered load is `load`.

    For closed-loop sessions (agent traces) only the session starts scale; their think
    times do not, so the achieved load is approximate there."""
    if not 0 < load:
        raise ValueError(f"load must be > 0, got {load}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    starts = [r.arrival_s for r in requests if r.after is None]
    span_s = max(starts) - min(starts) if starts else 0.0
    if span_s <= 0:
        raise ValueError("the trace's arrivals span no time; cannot scale it to a load")
    work_s = total_work_s(requests, profile)
    # load = work_s / (num_replicas * span_s * factor)
    return work_s / (num_replicas * span_s * load)
