"""Selective prefill/decode splitting: which requests go through a prefill replica.

One rule for the live router and the simulator. The decode replica is chosen first, by the
routing policy over the decode pool, exactly as for colocated serving. The request is then
split (prefilled on a prefill replica, its KV sent to the decode replica, which decodes
from there) only when all of these hold:

- its uncached prompt on the decode replica is at least `min_uncached_tokens`: a short
  prefill costs the decode batch one short step, and the transfer's fixed cost would
  outweigh what splitting saves (llm-d's selective split uses the same length test);
- the decode replica has at least `min_decoding` requests in flight: with nobody decoding
  there, a colocated prefill stalls no one;
- the best prefill replica would have the KV on the decode side within `max_slowdown`
  times the decode replica's own predicted prefill time, or within `ttft_budget_s` (a
  share of the TTFT SLO). Splitting trades some TTFT for steady decode steps, never an
  unbounded amount: a backed-up prefill pool sends requests home instead of queueing them.

Predicted prefill times are the `once` policy's (`predicted_prefill_s`); the split side adds
the transfer of the tokens the decode replica lacks, at `transfer_s_per_token`. With
`prefix_from_decode`, a prefill replica that lacks part of the prefix the decode replica
holds fetches that part (from a KV store both share, or from the decode replica itself) at
the same rate instead of recomputing it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from once.router.policies import (
    ReplicaView,
    RequestView,
    pick_lowest,
    predicted_prefill_s,
    uncached_tokens,
)

# Why a request went where it went; the router counts each (its /metrics:
# `once_engine_pd_decisions_<reason>`, beside the pairs and the tokens split).
SPLIT = "split"
SHORT = "short"  # uncached prompt under the threshold
IDLE = "idle"  # the decode replica had too few requests in flight to be disturbed
PREFILL_BUSY = "prefill_busy"  # the prefill pool would be too slow
NO_PREFILL = "no_prefill"  # no healthy prefill replica
DECISIONS = (SPLIT, SHORT, IDLE, PREFILL_BUSY, NO_PREFILL)


@dataclass(frozen=True)
class SplitDecision:
    reason: str
    prefill_index: int | None = None  # the chosen prefill ReplicaView.index when split
    num_uncached_tokens: int = 0  # on the decode replica: what a split would send


@dataclass(frozen=True)
class SplitPolicy:
    min_uncached_tokens: int = 2048
    min_decoding: int = 1
    max_slowdown: float = 1.5
    transfer_s_per_token: float = 0.0
    prefix_from_decode: bool = False
    ttft_budget_s: float = 0.0

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 1:
            raise ValueError("min_uncached_tokens must be >= 1")
        if self.min_decoding < 0:
            raise ValueError("min_decoding must be >= 0")
        if self.max_slowdown < 1.0:
            raise ValueError("max_slowdown must be >= 1.0")
        if self.ttft_budget_s < 0:
            raise ValueError("ttft_budget_s must be >= 0")
        if self.transfer_s_per_token < 0:
            raise ValueError("transfer_s_per_token must be >= 0")

    def decide(
        self,
        request: RequestView,
        decode: ReplicaView,
        prefills: Sequence[ReplicaView],
        rng: random.Random,
    ) -> SplitDecision:
        uncached = uncached_tokens(request, decode)
        if uncached < self.min_uncached_tokens:
            return SplitDecision(SHORT, num_uncached_tokens=uncached)
        if decode.num_running < self.min_decoding:
            return SplitDecision(IDLE, num_uncached_tokens=uncached)
        candidates = [replica for replica in prefills if replica.healthy]
        if not candidates:
            return SplitDecision(NO_PREFILL, num_uncached_tokens=uncached)
        transfer_s = uncached * self.transfer_s_per_token
        decode_matched = request.num_prompt_tokens - uncached

        def split_s(replica: ReplicaView) -> float:
            if not self.prefix_from_decode:
                return predicted_prefill_s(request, replica) + transfer_s
            # The prefill replica fetches the prefix it lacks and the decode side holds.
            own = request.num_prompt_tokens - uncached_tokens(request, replica)
            pulled = max(0, decode_matched - own)
            queued = replica.num_queued_prefill_tokens + min(
                uncached, request.num_prompt_tokens - own
            )
            compute_s = queued / max(replica.prefill_tokens_per_s, 1e-9)
            return compute_s + pulled * self.transfer_s_per_token + transfer_s

        chosen = pick_lowest(candidates, split_s, rng)
        best = next(replica for replica in candidates if replica.index == chosen)
        allowed_s = max(
            self.max_slowdown * predicted_prefill_s(request, decode), self.ttft_budget_s
        )
        if split_s(best) > allowed_s:
            return SplitDecision(PREFILL_BUSY, num_uncached_tokens=uncached)
        return SplitDecision(SPLIT, chosen, uncached)
