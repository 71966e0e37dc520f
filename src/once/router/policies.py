"""Routing policies, one implementation shared by the live router and the simulator.

INTERFACE (fixed; the simulator in `once.sim` is built on it):

    @dataclass(frozen=True)
    class RequestView:
        request_id: str
        num_prompt_tokens: int
        block_hashes: tuple[int, ...]      # chained hashes of the prompt's full blocks
        block_size: int
        session_key: str | None = None     # prompt_cache_key
        max_output_tokens: int = 0

    @dataclass(frozen=True)
    class ReplicaView:
        index: int
        name: str
        healthy: bool
        num_running: int                   # requests in flight
        num_queued_prefill_tokens: int     # prompt tokens waiting to be prefilled
        num_decode_tokens: int             # output tokens still to decode (estimate)
        kv_blocks_used: int                # blocks held by in-flight requests
        kv_blocks_total: int
        cached_prefix_blocks: int          # of THIS request, from the replica's prefix index
        prefill_tokens_per_s: float        # measured (live) or profiled (sim)
        decode_tokens_per_s: float         # aggregate over the replica's running batch
        tier_prefix_blocks: tuple[int, ...] = ()  # the match's continuation in each KV
                                           # tier below the device (sim: host, disk)
        tier_load_s: float = 0.0           # time to load those blocks into the device

    class Policy(Protocol):
        name: str
        def choose(self, request: RequestView, replicas: Sequence[ReplicaView],
                   rng: random.Random) -> int   # the chosen ReplicaView.index (healthy only)

    POLICIES: dict[str, Callable[..., Policy]]   # name -> factory(**params)
    def make_policy(name: str, **params) -> Policy

Rules every policy follows:
- Only healthy replicas are candidates; with none, `choose` raises `EngineDeadError`.
- "Load" is the number of requests in flight (`num_running`), then pending work in tokens.
- Ties go to the lower load, then to a draw from `rng`, never to the lower index: with the
  same rng seed, the router and the simulator take the same decisions in the same order.
- Policies may keep state (round-robin's cursor, session homes); it depends only on the
  sequence of `choose` calls, never on wall time.
"""

import bisect
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from once.protocol.errors import EngineDeadError


@dataclass(frozen=True)
class RequestView:
    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]
    block_size: int
    session_key: str | None = None
    max_output_tokens: int = 0


@dataclass(frozen=True)
class ReplicaView:
    index: int
    name: str
    healthy: bool
    num_running: int
    num_queued_prefill_tokens: int
    num_decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    cached_prefix_blocks: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    tier_prefix_blocks: tuple[int, ...] = ()
    tier_load_s: float = 0.0

    @property
    def matched_prefix_blocks(self) -> int:
        """The prefix this replica need not recompute: on the device or in a lower tier."""
        return self.cached_prefix_blocks + sum(self.tier_prefix_blocks)


class Policy(Protocol):
    name: str

    def choose(
        self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random
    ) -> int: ...


# -- shared helpers -------------------------------------------------------------------------


def healthy_replicas(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    candidates = [replica for replica in replicas if replica.healthy]
    if not candidates:
        raise EngineDeadError("no healthy replica to route to")
    return candidates


def load_key(replica: ReplicaView) -> tuple[int, int]:
    return (replica.num_running, replica.num_queued_prefill_tokens + replica.num_decode_tokens)


def pick_lowest(
    candidates: Sequence[ReplicaView],
    score: Callable[[ReplicaView], float],
    rng: random.Random,
) -> int:
    """The index of the lowest `score`; ties to the lower load, then at random."""
    best = min(score(replica) for replica in candidates)
    # Relative tolerance: scores are sums of float quotients, equal work must compare equal.
    tied = [r for r in candidates if score(r) <= best + 1e-9 * max(1.0, abs(best))]
    lowest_load = min(load_key(replica) for replica in tied)
    tied = [replica for replica in tied if load_key(replica) == lowest_load]
    return tied[rng.randrange(len(tied))].index if len(tied) > 1 else tied[0].index


def uncached_tokens(request: RequestView, replica: ReplicaView) -> int:
    """Prompt tokens the replica would compute: past its match on the device and in tiers."""
    matched = replica.matched_prefix_blocks * request.block_size
    return max(1, request.num_prompt_tokens - matched)


def predicted_prefill_s(request: RequestView, replica: ReplicaView) -> float:
    """The replica's queued prefill plus this request's uncached part at its prefill speed,
    plus the load of its prefix from lower KV tiers."""
    queued = replica.num_queued_prefill_tokens + uncached_tokens(request, replica)
    return queued / max(replica.prefill_tokens_per_s, 1e-9) + replica.tier_load_s


def stable_hash(text: str) -> int:
    # Python's hash() is salted per process; the ring must agree across processes.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _check_non_negative(**params: float) -> None:
    for name, value in params.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


# -- baselines ------------------------------------------------------------------------------


class RoundRobin:
    """Each request to the next healthy replica after the last one chosen (by position)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last_index: int | None = None

    def choose(self, request, replicas, rng) -> int:
        candidates = sorted(healthy_replicas(replicas), key=lambda replica: replica.index)
        after = [r for r in candidates if self._last_index is None or r.index > self._last_index]
        chosen = (after or candidates)[0].index
        self._last_index = chosen
        return chosen


class LeastLoaded:
    """Fewest requests in flight (SGLang's `shortest_queue` / vLLM production-stack's
    least-load): ties by pending tokens, then at random."""

    name = "least_loaded"

    def choose(self, request, replicas, rng) -> int:
        return pick_lowest(healthy_replicas(replicas), lambda replica: 0.0, rng)


class PowerOfTwo:
    """Two healthy replicas drawn at random, the less loaded one wins (Mitzenmacher 2001;
    SGLang router's `power_of_two` compares the same in-flight load)."""

    name = "power_of_two"

    def choose(self, request, replicas, rng) -> int:
        candidates = healthy_replicas(replicas)
        if len(candidates) > 2:
            candidates = rng.sample(candidates, 2)
        return pick_lowest(candidates, lambda replica: 0.0, rng)


class CacheAware:
    """SGLang router's cache-aware policy (sgl-router, `policies/cache_aware.rs`).

    1. The system is imbalanced when max_load - min_load > balance_abs_threshold AND
       max_load > min_load * balance_rel_threshold (load = requests in flight); then the
       least-loaded replica wins.
    2. Otherwise the replica with the longest cached prefix wins if its match rate
       (matched / prompt tokens) exceeds cache_threshold; below it, the replica with the
       smallest cache ("smallest tree"; here the fewest KV blocks in use) wins.

    Defaults from sglang_router `router_args.py` (RouterArgs): cache_threshold=0.3,
    balance_abs_threshold=64, balance_rel_threshold=1.5. SGLang matches characters in a
    radix tree; here the match is in full blocks from the replica's prefix index.
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ):
        _check_non_negative(
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
        )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(self, request, replicas, rng) -> int:
        candidates = healthy_replicas(replicas)
        loads = [replica.num_running for replica in candidates]
        max_load, min_load = max(loads), min(loads)
        imbalanced = (
            max_load - min_load > self.balance_abs_threshold
            and max_load > min_load * self.balance_rel_threshold
        )
        if imbalanced:
            return pick_lowest(candidates, lambda replica: 0.0, rng)
        best_match = max(replica.cached_prefix_blocks for replica in candidates)
        match_rate = best_match * request.block_size / max(1, request.num_prompt_tokens)
        if best_match > 0 and match_rate > self.cache_threshold:
            return pick_lowest(candidates, lambda replica: -replica.cached_prefix_blocks, rng)
        return pick_lowest(candidates, lambda replica: replica.kv_blocks_used, rng)


class DynamoCost:
    """NVIDIA Dynamo's KV router cost (docs: components/router, "Cost Calculation"):

        cost = overlap_score_weight * prefill_blocks + decode_blocks
        prefill_blocks = (queued prompt tokens + this prompt - cached blocks * block) / block
        decode_blocks  = blocks held by active requests + this request's blocks

    the lowest cost wins. Defaults from Dynamo's router flags:
    `--router-kv-overlap-score-weight 1`, `--router-temperature 0` (deterministic argmin;
    a positive temperature samples softmax(-cost / temperature))."""

    name = "dynamo"

    def __init__(self, overlap_score_weight: float = 1.0, temperature: float = 0.0):
        _check_non_negative(overlap_score_weight=overlap_score_weight, temperature=temperature)
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature

    def cost(self, request: RequestView, replica: ReplicaView) -> float:
        block = request.block_size
        uncached = request.num_prompt_tokens - replica.cached_prefix_blocks * block
        prefill_blocks = (replica.num_queued_prefill_tokens + max(0, uncached)) / block
        decode_blocks = replica.kv_blocks_used + -(-request.num_prompt_tokens // block)
        return self.overlap_score_weight * prefill_blocks + decode_blocks

    def choose(self, request, replicas, rng) -> int:
        candidates = healthy_replicas(replicas)
        if self.temperature == 0:
            return pick_lowest(candidates, lambda replica: self.cost(request, replica), rng)
        costs = [self.cost(request, replica) for replica in candidates]
        lowest = min(costs)
        weights = [math.exp(-(c - lowest) / self.temperature) for c in costs]
        return rng.choices(candidates, weights=weights)[0].index


class ConsistentHashRing:
    """Replica names on a hash ring with virtual nodes; a key maps to the first healthy
    replica clockwise, so removing one replica moves only its keys."""

    def __init__(self, virtual_nodes: int = 160):
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self.virtual_nodes = virtual_nodes
        self._names: frozenset[str] = frozenset()
        self._points: list[tuple[int, str]] = []

    def _rebuild(self, names: frozenset[str]) -> None:
        self._names = names
        self._points = sorted(
            (stable_hash(f"{name}#{i}"), name) for name in names for i in range(self.virtual_nodes)
        )

    def lookup(self, key: str, replicas: Sequence[ReplicaView]) -> int:
        names = frozenset(replica.name for replica in replicas)
        if names != self._names:
            self._rebuild(names)
        by_name = {replica.name: replica for replica in replicas}
        start = bisect.bisect_left(self._points, (stable_hash(key), ""))
        for offset in range(len(self._points)):
            _, name = self._points[(start + offset) % len(self._points)]
            if by_name[name].healthy:
                return by_name[name].index
        raise EngineDeadError("no healthy replica to route to")


class SessionAffinity:
    """Consistent hashing on `prompt_cache_key` (the session), as in vLLM production-stack's
    session router and SGLang's `consistent_hash`. A request without a key falls back to
    the least-loaded replica. `virtual_nodes=160` is ketama's (libketama) default."""

    name = "session_affinity"

    def __init__(self, virtual_nodes: int = 160):
        self.ring = ConsistentHashRing(virtual_nodes)

    def choose(self, request, replicas, rng) -> int:
        healthy_replicas(replicas)
        if request.session_key is None:
            return pick_lowest(healthy_replicas(replicas), lambda replica: 0.0, rng)
        return self.ring.lookup(request.session_key, replicas)


# -- once -----------------------------------------------------------------------------------


class PredictedTTFT:
    """once's policy: the lowest predicted time to first token, with session affinity.

        ttft(replica) = (queued prefill tokens + uncached tokens of this request)
                          / replica prefill speed
                        + decode_weight * pending decode tokens / replica decode speed

    The uncached part comes from the replica's prefix index, so cache affinity and load are
    weighed in one unit (seconds) at each replica's own measured speed; a slow replica
    looks as far away as it is. A prefix held in a KV tier below the device (host memory,
    disk) is not uncached: it costs its load time (`tier_load_s`), added to the prefill.
    decode_weight is 0 by default: in a chunked-prefill engine pending decodes do not queue
    ahead of a prefill but share its steps (which the measured prefill speed already
    includes), and the per-stream decode speed the router measures is a poor proxy for the
    delay they add (it mixes in the prefill chunks those streams shared steps with).

    Session affinity: a session's later requests stay on its home replica (the one that
    served it last) unless another replica's prefill work ahead of the first token
    (queued + uncached tokens, plus the tier load) is smaller by more than
    `affinity_margin` (a fraction of the home's; 0.5: the other must have half the work
    ahead), so an approximate index or a noisy speed estimate does not bounce a
    conversation between replicas, yet a home whose queue grew long is left. The check
    prices both replicas' work at one speed (the faster one's): the measured speeds of
    replicas that share a busy machine swing by more than the margin, and a move on such
    a swing recomputes the session's whole history on a replica that then holds a second
    copy of it, which every later call of the session pays for in cache room. A replica
    that is really slower is still avoided by requests without a session key, and its
    sessions leave it when its queue grows. The check leaves the decode term out whatever
    decode_weight is: it stands for the load a request adds to a busy batch, not worth
    throwing its session's cache away for (with it in, the check overrates a busy home's
    TTFT and moves sessions off their cache).

    Placement: a new session (or one whose home is gone) goes to a replica holding the
    fewest resident sessions (the most recent ones whose last prompts fit all caches
    together), the lowest predicted TTFT among those. A session's history comes back with
    every call, so the sessions a replica holds are its coming load and cache pressure;
    the momentary queue and speed of a first call are not (two idle replicas of one build
    measure speeds up to 2x apart, and every new session went to the one that looked
    faster).

    Prefix affinity, for requests without a session key (the Mooncake trace has none):
    the replica holding the longest cached prefix (device and lower tiers together), when
    it is longer than the chosen replica's, is the request's home, left only if another
    replica's predicted prefill is shorter by more than `prefix_affinity_margin` (0.9: only
    for a replica predicted 10x faster). A conversation's turns then keep landing where its
    history is, instead of wherever a momentary queue is shortest, which copies the history
    onto several replicas and divides the cache's reach.

    The margins and the decode weight are once's own (there is no published default);
    DESIGN.md ("Tuning record") has the runs they were chosen on.
    """

    name = "once"

    def __init__(
        self,
        decode_weight: float = 0.0,
        affinity_margin: float = 0.5,
        prefix_affinity_margin: float = 0.9,
        max_sessions: int = 100_000,
    ):
        _check_non_negative(
            decode_weight=decode_weight,
            affinity_margin=affinity_margin,
            prefix_affinity_margin=prefix_affinity_margin,
        )
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.decode_weight = decode_weight
        self.affinity_margin = affinity_margin
        self.prefix_affinity_margin = prefix_affinity_margin
        self.max_sessions = max_sessions
        # session key -> (home replica name, prompt tokens of its last request), LRU first
        self._homes: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def predicted_prefill_s(self, request: RequestView, replica: ReplicaView) -> float:
        return predicted_prefill_s(request, replica)

    def predicted_ttft_s(self, request: RequestView, replica: ReplicaView) -> float:
        decode_s = replica.num_decode_tokens / max(replica.decode_tokens_per_s, 1e-9)
        return self.predicted_prefill_s(request, replica) + self.decode_weight * decode_s

    def choose(self, request, replicas, rng) -> int:
        candidates = healthy_replicas(replicas)
        key = request.session_key
        home_name = self._homes[key][0] if key is not None and key in self._homes else None
        home = next((r for r in candidates if r.name == home_name), None)
        if key is not None and home is None:
            chosen = self._place_session(request, candidates, rng)
        else:
            chosen = pick_lowest(candidates, lambda r: self.predicted_ttft_s(request, r), rng)
        if key is None:
            return self._prefix_home(request, candidates, chosen, rng)
        if home is not None and home.index != chosen:
            best = next(r for r in candidates if r.index == chosen)
            speed = max(home.prefill_tokens_per_s, best.prefill_tokens_per_s)
            best_s = predicted_prefill_s(request, replace(best, prefill_tokens_per_s=speed))
            home_s = predicted_prefill_s(request, replace(home, prefill_tokens_per_s=speed))
            if best_s >= home_s * (1 - self.affinity_margin):
                chosen = home.index
        self._homes[key] = (
            next(r.name for r in candidates if r.index == chosen),
            request.num_prompt_tokens,
        )
        self._homes.move_to_end(key)
        if len(self._homes) > self.max_sessions:
            self._homes.popitem(last=False)
        return chosen

    def _place_session(self, request, candidates, rng) -> int:
        """A new session's home: among the replicas that hold the fewest resident sessions,
        the lowest predicted TTFT. Resident: the most recent sessions whose histories
        (their last prompts) fit the candidates' caches together; older ones are evicted
        anyway and pin nothing."""
        room = sum(r.kv_blocks_total for r in candidates) * request.block_size
        resident = {r.name: 0 for r in candidates}
        for name, num_tokens in reversed(self._homes.values()):
            room -= num_tokens
            if room < 0:
                break
            if name in resident:
                resident[name] += 1
        fewest = min(resident.values())
        emptiest = [r for r in candidates if resident[r.name] == fewest]
        return pick_lowest(emptiest, lambda r: self.predicted_ttft_s(request, r), rng)

    def _prefix_home(self, request, candidates, chosen: int, rng) -> int:
        best = next(r for r in candidates if r.index == chosen)
        deepest = max(r.matched_prefix_blocks for r in candidates)
        if deepest <= best.matched_prefix_blocks:
            return chosen
        holders = [r for r in candidates if r.matched_prefix_blocks == deepest]
        home_index = pick_lowest(holders, lambda r: self.predicted_ttft_s(request, r), rng)
        home = next(r for r in holders if r.index == home_index)
        best_s = self.predicted_prefill_s(request, best)
        if best_s >= self.predicted_prefill_s(request, home) * (1 - self.prefix_affinity_margin):
            return home.index
        return chosen


POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PowerOfTwo.name: PowerOfTwo,
    CacheAware.name: CacheAware,
    DynamoCost.name: DynamoCost,
    SessionAffinity.name: SessionAffinity,
    PredictedTTFT.name: PredictedTTFT,
}


def make_policy(name: str, **params) -> Policy:
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    try:
        return factory(**params)
    except TypeError as exc:  # an unknown parameter name
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from exc
