"""KV tiers below a replica's device pool: host memory (L2) and local disk (L3).

    device pool --evict--> L2 host --evict--> L3 disk --evict--> gone
         ^                   |                   |
         +------load---------+-------load--------+

Write-back: a block reaches L2 only when the device pool evicts it, L3 only when L2 evicts
it. Writes cost nothing in the model: they run on the copy engine's device-to-host
direction while the step loop runs, and nobody waits for them. A tier keeps its copy when
a request loads a block back up (as LMCache and SGLang's HiCache do), so a block may sit
in the device pool and in L2 at once; the device evicting a block L2 still holds only
refreshes L2's copy. Each tier picks its victims with an `EvictionPolicy`, the same
contract and code as the device pool; every block in a tier is evictable (nothing holds
it).

Loads: at admission a request's prefix match continues past the device pool, block by
block, in L2 or else L3, up to the first block in neither. Those blocks are not
recomputed: the request waits `latency + bytes / bandwidth` per tier it reads from (tiers
one after the other: an L3 read goes through host memory), then joins prefill. The step
loop does not wait: it runs on without the request. Loaded blocks need device space like
computed ones, and they get it: a request reserves all its blocks at admission, loaded
ones included, so a load is never cut short for lack of device space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from once.kv_eviction.base import EvictionPolicy
from once.sim.kvcache import Lineage
from once.sim.profiles import ReplicaProfile

TIER_NAMES = ("host", "disk")  # L2, L3


@dataclass(frozen=True)
class TierConfig:
    """Capacities as multiples of the device pool's blocks; 0 turns a tier off."""

    host_ratio: float = 0.0
    disk_ratio: float = 0.0
    host_eviction: str = "lru"
    disk_eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.host_ratio < 0 or self.disk_ratio < 0:
            raise ValueError("tier ratios must be >= 0")
        if self.disk_ratio > 0 and self.host_ratio == 0:
            raise ValueError("a disk tier needs a host tier above it (--host-tier-ratio > 0)")

    @property
    def enabled(self) -> bool:
        return self.host_ratio > 0


@dataclass
class TierStats:
    num_hit_blocks: int = 0
    num_hit_tokens: int = 0  # prompt tokens not recomputed thanks to this tier
    num_loaded_bytes: int = 0
    load_s: float = 0.0  # summed over requests
    num_loads: int = 0  # requests that read from this tier
    num_writes: int = 0  # blocks written into this tier (not refreshes)
    num_evictions: int = 0


class TierStore:
    """One tier: a capacity-bounded set of unreferenced blocks, victims chosen by `policy`,
    each victim written to the tier `below` (if any). Invariant: len(blocks) <= capacity."""

    def __init__(
        self,
        name: str,
        capacity: int,
        policy: EvictionPolicy,
        bandwidth_bytes_per_s: float,
        load_latency_s: float,
        below: TierStore | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"tier {name!r}: capacity must be >= 1 block, got {capacity}")
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"tier {name!r}: the profile gives no bandwidth for it")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.load_latency_s = load_latency_s
        self.below = below
        self.lineage: dict[int, Lineage] = {}  # every block in the tier
        self.stats = TierStats()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.lineage

    def __len__(self) -> int:
        return len(self.lineage)

    def put(self, block_hash: int, lineage: Lineage, now: float) -> None:
        if block_hash in self.lineage:
            self.touch(block_hash, now)
            return
        parent, depth, is_prompt_tail = lineage
        # A prefix-aware policy links a block to its parent only if the parent is already
        # here: blocks arrive in eviction order, not parent first, and a parent that came
        # later must not count a child it never saw (its count would go negative).
        linked_parent = parent if parent is not None and parent in self.lineage else None
        self.policy.stored(block_hash, linked_parent, depth, is_prompt_tail, now)
        self.policy.released(block_hash, now)
        self.lineage[block_hash] = lineage
        self.stats.num_writes += 1
        while len(self.lineage) > self.capacity:
            victim = self.policy.evict(now)
            victim_lineage = self.lineage.pop(victim)
            self.stats.num_evictions += 1
            if self.below is not None:
                self.below.put(victim, victim_lineage, now)

    def touch(self, block_hash: int, now: float) -> None:
        # A use: through the policy's own life cycle, held for an instant then released.
        policy = self.policy
        policy.hit(block_hash, now)
        policy.acquired(block_hash, now)
        policy.released(block_hash, now)

    def load_s(self, num_blocks: int, block_bytes: int) -> float:
        if not num_blocks:
            return 0.0
        return self.load_latency_s + num_blocks * block_bytes / self.bandwidth_bytes_per_s


@dataclass
class LowerTiers:
    """A replica's tiers below its device pool, top first."""

    stores: list[TierStore]
    block_bytes: int
    pending: list[float] = field(default_factory=list)  # load ends the cluster must wake at

    @property
    def top(self) -> TierStore:
        return self.stores[0]

    def match(self, hashes: Sequence[int], start: int) -> list[int]:
        """Blocks of `hashes` from `start` on found in each tier, per tier."""
        counts = [0] * len(self.stores)
        for tier, _ in self._walk(hashes, start):
            counts[tier] += 1
        return counts

    def load_s(self, counts: Sequence[int]) -> float:
        return sum(
            store.load_s(num, self.block_bytes)
            for store, num in zip(self.stores, counts, strict=True)
        )

    def load(self, hashes: Sequence[int], start: int, now: float) -> list[int]:
        """Read the tier-held continuation of a prefix the device matched up to `start`:
        refresh each block in its tier and count the traffic. Returns blocks per tier."""
        counts = [0] * len(self.stores)
        for tier, block_hash in self._walk(hashes, start):
            self.stores[tier].touch(block_hash, now)
            counts[tier] += 1
        for store, num in zip(self.stores, counts, strict=True):
            if num:
                stats = store.stats
                stats.num_hit_blocks += num
                stats.num_loaded_bytes += num * self.block_bytes
                stats.load_s += store.load_s(num, self.block_bytes)
                stats.num_loads += 1
        return counts

    def _walk(self, hashes: Sequence[int], start: int) -> list[tuple[int, int]]:
        # (tier, hash) of each block from `start` on, from the highest tier holding it, up
        # to the first block no tier holds.
        found = []
        for block_hash in hashes[start:]:
            tier = next((i for i, s in enumerate(self.stores) if block_hash in s), None)
            if tier is None:
                break
            found.append((tier, block_hash))
        return found

    def admitted(self, hashes: Sequence[int], now: float) -> None:
        for store in self.stores:
            store.policy.admitted(hashes, now)


def build_tiers(
    profile: ReplicaProfile,
    device_blocks: int,
    config: TierConfig,
    make_policy: Callable[[str], EvictionPolicy],
) -> LowerTiers | None:
    """The tiers `config` asks for under a device pool of `device_blocks`; None when off.
    `make_policy(tier name)` gives each tier its eviction policy."""
    if not config.enabled:
        return None
    block_bytes = profile.kv_block_bytes
    ratios = (config.host_ratio, config.disk_ratio)
    bandwidths = (profile.host_bandwidth_bytes_per_s, profile.disk_bandwidth_bytes_per_s)
    latencies = (profile.host_load_latency_s, profile.disk_load_latency_s)
    stores: list[TierStore] = []  # built bottom up, so each knows the one below it
    for name, ratio, bandwidth, latency in reversed(
        list(zip(TIER_NAMES, ratios, bandwidths, latencies, strict=True))
    ):
        if ratio <= 0:
            continue
        below = stores[0] if stores else None
        capacity = max(1, round(ratio * device_blocks))
        stores.insert(0, TierStore(name, capacity, make_policy(name), bandwidth, latency, below))
    return LowerTiers(stores, block_bytes)
