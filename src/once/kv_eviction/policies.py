"""Eviction policies for a KV prefix cache, beyond the LRU of `once.kv_eviction.base`.

All of them are prefix-aware (`LeafFirstPolicy`): only leaves go, a block whose children are
cached outlives them. They differ in which leaf goes first:

- `leaf-lru`: the least recently used leaf.
- `lfu-da`: LFU with dynamic aging (Arlitt et al., 2000): priority = L + 1 + hits, where L
  rises to the priority of each victim, so counts from long ago stop protecting a block.
- `reuse`: Least Hit Density (Beckmann et al., NSDI'18), learned online from the past only.
  Blocks fall in classes by what the trace's structure says about reuse: hits so far (a
  conversation that came back once tends to come back again), whether the block was the
  last of its prompt (Mooncake's last block is partial: its hash changes when the
  conversation grows, so it is almost never hit again), and prefix depth. Per class it keeps
  decayed histograms of the age (seconds since the block became unreferenced) at which blocks
  were hit or evicted, and evicts the block with the fewest expected future hits per second
  of cache space it is expected to occupy.
- `belady`: the offline optimum's rule, evict the block needed farthest in the future, with
  the trace's own future. A reference bound only: it sees the future.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from once.kv_eviction.base import LRU, BlockInfo, EvictionPolicy, LeafFirstPolicy


class LeafLRU(LeafFirstPolicy):
    name = "leaf-lru"

    def priority(self, block_hash: int, now: float) -> tuple:
        return (self.blocks[block_hash].last_access_s,)


class LFUDynamicAging(LeafFirstPolicy):
    name = "lfu-da"

    def __init__(self, rng: random.Random | None = None):
        super().__init__(rng)
        self.inflation = 0.0  # L: the priority of the last victim

    def released(self, block_hash: int, now: float) -> None:
        super().released(block_hash, now)
        info = self.blocks[block_hash]
        info.score = self.inflation + 1 + info.num_hits

    def priority(self, block_hash: int, now: float) -> tuple:
        info = self.blocks[block_hash]
        return (info.score, info.last_access_s)

    def evict(self, now: float) -> int:
        victim, info = self._evict_leaf(now)
        self.inflation = max(self.inflation, info.score)
        return victim


# Age buckets of the hit-density model: geometric, 4 per doubling from 0.25 s to ~17 min.
_AGE_BASE_S = 0.25
_BUCKETS_PER_DOUBLING = 4
_NUM_AGES = 12 * _BUCKETS_PER_DOUBLING + 1
_AGE_EDGES = [0.0] + [
    _AGE_BASE_S * 2 ** (i / _BUCKETS_PER_DOUBLING) for i in range(_NUM_AGES)
]  # bucket a spans [_AGE_EDGES[a], _AGE_EDGES[a + 1])
_AGE_MIDS = [(_AGE_EDGES[a] + _AGE_EDGES[a + 1]) / 2 for a in range(_NUM_AGES)]
_MAX_HITS_CLASS = 3
_DEPTH_CLASSES = (4, 16)  # depth < 4, < 16, deeper


def age_bucket(age_s: float) -> int:
    if age_s < _AGE_BASE_S:
        return 0
    bucket = 1 + int(math.log2(age_s / _AGE_BASE_S) * _BUCKETS_PER_DOUBLING)
    return min(bucket, _NUM_AGES - 1)


class ReuseDensity(LeafFirstPolicy):
    name = "reuse"
    recompute_every = 2000  # hit/eviction events between refits of the density table
    decay = 0.9  # old events fade at each refit, so the model follows the trace

    def __init__(self, rng: random.Random | None = None, sample_size: int | None = 32):
        super().__init__(rng, sample_size)
        num_classes = (_MAX_HITS_CLASS + 1) * 2 * (len(_DEPTH_CLASSES) + 1)
        self.hits = [[0.0] * _NUM_AGES for _ in range(num_classes)]
        self.evictions = [[0.0] * _NUM_AGES for _ in range(num_classes)]
        self.density = [[0.0] * _NUM_AGES for _ in range(num_classes)]
        self.num_events = 0

    @staticmethod
    def block_class(info: BlockInfo) -> int:
        depth_class = sum(info.depth >= edge for edge in _DEPTH_CLASSES)
        hits_class = min(info.num_hits, _MAX_HITS_CLASS)
        return (hits_class * 2 + info.is_prompt_tail) * (len(_DEPTH_CLASSES) + 1) + depth_class

    def acquired(self, block_hash: int, now: float) -> None:
        # A hit on an unreferenced block ends one evictable lifetime with a hit.
        info = self.blocks[block_hash]
        self.hits[self.block_class(info)][age_bucket(now - info.released_s)] += 1
        super().acquired(block_hash, now)
        self._count_event()

    def priority(self, block_hash: int, now: float) -> tuple:
        info = self.blocks[block_hash]
        age_s = now - info.released_s
        return (self.density[self.block_class(info)][age_bucket(age_s)], -age_s)

    def evict(self, now: float) -> int:
        victim, info = self._evict_leaf(now)
        self.evictions[self.block_class(info)][age_bucket(now - info.released_s)] += 1
        self._count_event()
        return victim

    def _count_event(self) -> None:
        self.num_events += 1
        if self.num_events % self.recompute_every == 0:
            self.refit()

    def refit(self) -> None:
        """density[c][a] = expected hits / expected remaining lifetime of a block of class c
        at age bucket a, from the events at ages >= a (suffix sums over the buckets):
        lifetime(a) = sum over x >= a of events(x) * (mid(x) - edge(a))."""
        for hits, evictions, density in zip(self.hits, self.evictions, self.density, strict=True):
            num_hits = num_events = weighted_age = 0.0
            for a in range(_NUM_AGES - 1, -1, -1):
                num_hits += hits[a]
                num_events += hits[a] + evictions[a]
                weighted_age += (hits[a] + evictions[a]) * _AGE_MIDS[a]
                lifetime = weighted_age - num_events * _AGE_EDGES[a]
                density[a] = num_hits / lifetime if lifetime > 0 else 0.0
                hits[a] *= self.decay
                evictions[a] *= self.decay


class FutureOracle:
    """The trace's future, shared by every replica of a cluster: for each block, the arrival
    times of the requests that contain it, and how many of those were admitted so far."""

    def __init__(self) -> None:
        self.arrivals: dict[int, list[float]] = {}
        self.num_admitted: dict[int, int] = {}
        self.prepared_for: object = None

    def prepare(self, requests: Sequence) -> None:
        if self.prepared_for is requests:
            return
        self.prepared_for = requests
        self.arrivals, self.num_admitted = {}, {}
        for request in sorted(requests, key=lambda r: r.arrival_s):
            for block_hash in request.block_hashes:
                self.arrivals.setdefault(block_hash, []).append(request.arrival_s)

    def admitted(self, hashes: Sequence[int]) -> None:
        # Requests are admitted close to arrival order, so the k-th admission consumes the
        # k-th arrival; the next arrival still to come is the block's next use.
        counts = self.num_admitted
        for block_hash in hashes:
            counts[block_hash] = counts.get(block_hash, 0) + 1

    def next_use_s(self, block_hash: int) -> float:
        times = self.arrivals.get(block_hash, ())
        index = self.num_admitted.get(block_hash, 0)
        return times[index] if index < len(times) else math.inf


class Belady(LeafFirstPolicy):
    name = "belady"

    def __init__(self, oracle: FutureOracle, rng: random.Random | None = None):
        super().__init__(rng, sample_size=None)  # exact: every leaf is a candidate
        self.oracle = oracle

    def prepare(self, requests: Sequence) -> None:
        self.oracle.prepare(requests)

    def admitted(self, hashes: Sequence[int], now: float) -> None:
        self.oracle.admitted(hashes)

    def priority(self, block_hash: int, now: float) -> tuple:
        return (-self.oracle.next_use_s(block_hash),)


EVICTION_POLICIES = ("lru", "leaf-lru", "lfu-da", "reuse", "belady")
ORACLE_EVICTION_POLICIES = ("belady",)
DEFAULT_EVICTION = "lfu-da"  # best online policy measured on the bar scenario (see the report)


def eviction_factory(name: str, seed: int = 0) -> Callable[[], EvictionPolicy]:
    """A maker of one policy per replica, each with its own seeded sampler (Belady's share
    one oracle, since admissions anywhere consume the trace's future)."""
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {EVICTION_POLICIES}")
    streams = iter(range(1 << 30))

    def rng() -> random.Random:
        return random.Random(seed * 1_000_003 + next(streams))

    if name == "lru":
        return LRU
    if name == "leaf-lru":
        return lambda: LeafLRU(rng())
    if name == "lfu-da":
        return lambda: LFUDynamicAging(rng())
    if name == "reuse":
        return lambda: ReuseDensity(rng())
    oracle = FutureOracle()
    return lambda: Belady(oracle, rng())
