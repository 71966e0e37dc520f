"""The KV capacity of one simulated replica, in blocks, with a prefix cache and pluggable
eviction.

Blocks are of two kinds. Shared blocks carry a prefix hash: they are found by
`match_prefix`, counted by reference, and when no running request holds them they stay
cached (evictable) until space is needed; the `EvictionPolicy` picks which goes first.
Private blocks belong to one running request: its prompt blocks until their prefill
completes (then they are published as shared), its output blocks, and duplicates of blocks
another request published first. As in vLLM, a finished request releases its shared blocks
tail first, so under LRU a prompt's tail is evicted before its head.

Invariant: num_used + len(policy) <= capacity, where num_used = len(refs) + num_private.
With a tier below (`once.sim.tiers`), every evicted block is written back to it.

The policy contract, LRU (the default of a bare `BlockCache`, as in vLLM and the once
engine) and the other policies are in `once.kv_eviction`, shared with the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from once.kv_eviction.base import LRU, EvictionPolicy

# (parent hash, depth in its prompt, is the prompt's last block): what a policy's `stored`
# is told, kept with a block so a lower tier can tell its own policy the same.
Lineage = tuple[int | None, int, bool]


class EvictedBlockSink(Protocol):
    def put(self, block_hash: int, lineage: Lineage, now: float) -> None: ...


class BlockCache:
    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy | None = None,
        below: EvictedBlockSink | None = None,  # where evicted blocks go; None: dropped
    ):
        if capacity < 1:
            raise ValueError(f"KV capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.policy = policy if policy is not None else LRU()
        self.below = below
        self.lineage: dict[int, Lineage] = {}  # of every shared block, kept only with `below`
        self.refs: dict[int, int] = {}  # shared block hash -> running requests holding it
        self.cached: set[int] = set()  # every shared block: held or evictable
        self.num_private = 0
        self.num_evictions = 0

    @property
    def lru(self) -> EvictionPolicy:
        """The evictable blocks (the name predates pluggable policies)."""
        return self.policy

    @property
    def num_used(self) -> int:
        return len(self.refs) + self.num_private

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` present in the cache."""
        cached = self.cached
        num = 0
        for block_hash in hashes:
            if block_hash not in cached:
                break
            num += 1
        return num

    def can_admit(self, hashes: Sequence[int], num_matched: int, num_blocks: int) -> bool:
        # Matched blocks stop being evictable (they become used); every other evictable
        # block can be evicted to make room for the new ones.
        refs = self.refs
        num_revived = sum(1 for h in hashes[:num_matched] if h not in refs)
        return self.num_used + num_revived + (num_blocks - num_matched) <= self.capacity

    def admit(
        self, hashes: Sequence[int], num_matched: int, num_blocks: int, now: float = 0.0
    ) -> list[int]:
        """Reference the matched prefix and allocate the other blocks privately.

        Returns the shared hashes this request now holds (to release later)."""
        if not self.can_admit(hashes, num_matched, num_blocks):
            raise ValueError("admit() without room: call can_admit() first")
        policy, refs = self.policy, self.refs
        held = list(hashes[:num_matched])
        for block_hash in held:
            if block_hash in refs:
                refs[block_hash] += 1
            else:
                policy.acquired(block_hash, now)
                refs[block_hash] = 1
            policy.hit(block_hash, now)
        policy.admitted(hashes, now)
        self.num_private += num_blocks - num_matched
        self._evict_to_capacity(now)
        return held

    def publish(self, hashes: Sequence[int], held: list[int], now: float = 0.0) -> None:
        """Turn a request's computed prompt blocks (after its matched prefix) into shared
        blocks. A hash already cached (published meanwhile by another request) stays a
        private duplicate; so does every block after it, to keep prefixes chained."""
        last = len(hashes) - 1
        for depth in range(len(held), len(hashes)):
            block_hash = hashes[depth]
            if block_hash in self.cached:
                return
            self.refs[block_hash] = 1
            self.cached.add(block_hash)
            self.num_private -= 1
            parent = hashes[depth - 1] if depth else None
            self.policy.stored(block_hash, parent, depth, depth == last, now)
            if self.below is not None:
                self.lineage[block_hash] = (parent, depth, depth == last)
            held.append(block_hash)

    def release(self, held: list[int], num_blocks: int, now: float = 0.0) -> None:
        self.num_private -= num_blocks - len(held)
        for block_hash in reversed(held):
            count = self.refs[block_hash] - 1
            if count:
                self.refs[block_hash] = count
            else:
                del self.refs[block_hash]
                self.policy.released(block_hash, now)

    def _evict_to_capacity(self, now: float) -> None:
        policy = self.policy
        while self.num_used + len(policy) > self.capacity and len(policy):
            victim = policy.evict(now)
            self.cached.discard(victim)
            self.num_evictions += 1
            if self.below is not None:
                self.below.put(victim, self.lineage.pop(victim), now)
