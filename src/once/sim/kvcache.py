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

This module holds the policy contract, LRU (the default of a bare `BlockCache`, as in vLLM
and the once engine) and the base of the prefix-aware policies; the others are in
`once.sim.eviction`.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

# (parent hash, depth in its prompt, is the prompt's last block): what a policy's `stored`
# is told, kept with a block so a lower tier can tell its own policy the same.
Lineage = tuple[int | None, int, bool]


class EvictedBlockSink(Protocol):
    def put(self, block_hash: int, lineage: Lineage, now: float) -> None: ...


class EvictionPolicy:
    """Sees each shared block's life and picks victims among the unreferenced ones.

    Life of a block: `stored` (published, held by its request) -> `released` (no request
    holds it: evictable) -> `acquired` (a new request matched it: held again) -> ... ->
    chosen by `evict`. `hit` is called for every matched block of an admitted request,
    held or not; `admitted` once per admitted request with all its prompt hashes.
    `len()` and `in` count the evictable blocks only."""

    name = "abstract"

    def prepare(self, requests: Sequence) -> None:
        """Called once with the whole trace before a run; only an oracle may look."""

    def stored(
        self, block_hash: int, parent: int | None, depth: int, is_prompt_tail: bool, now: float
    ) -> None:
        pass

    def hit(self, block_hash: int, now: float) -> None:
        pass

    def admitted(self, hashes: Sequence[int], now: float) -> None:
        pass

    def released(self, block_hash: int, now: float) -> None:
        raise NotImplementedError

    def acquired(self, block_hash: int, now: float) -> None:
        raise NotImplementedError

    def evict(self, now: float) -> int:
        """Remove and return one evictable block (the cache calls it only when len() > 0)."""
        raise NotImplementedError

    def demote(self, block_hash: int, now: float) -> None:
        """An evictable block is known not to be needed soon (its session paused for a long
        tool): make it among the first to go. A policy may ignore it."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, block_hash: object) -> bool:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """One list of unreferenced blocks, least recently released first."""

    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def released(self, block_hash: int, now: float) -> None:
        self.order[block_hash] = None

    def acquired(self, block_hash: int, now: float) -> None:
        del self.order[block_hash]

    def evict(self, now: float) -> int:
        return self.order.popitem(last=False)[0]

    def demote(self, block_hash: int, now: float) -> None:
        if block_hash in self.order:
            self.order.move_to_end(block_hash, last=False)

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)


@dataclass(slots=True)
class BlockInfo:
    parent: int | None
    depth: int  # index of the block in its prompt
    is_prompt_tail: bool  # the last block of the prompt that stored it
    num_children: int = 0  # cached blocks whose parent this is
    num_hits: int = 0
    last_access_s: float = 0.0
    released_s: float = 0.0
    evictable: bool = False
    score: float = 0.0  # a policy's own per-block state


class LeafFirstPolicy(EvictionPolicy):
    """Prefix-aware base: only leaves (evictable blocks with no cached child) are victims,
    the one of lowest `priority` among `sample_size` random leaves (all when None or when
    there are fewer). A chained block is reachable only through its parent, so a parent is
    never evicted before its children; a held child implies a held parent, so once the
    leaves are gone nothing evictable is left."""

    name = "leaf-first"

    def __init__(self, rng: random.Random | None = None, sample_size: int | None = 32):
        self.rng = rng or random.Random(0)
        self.sample_size = sample_size
        self.blocks: dict[int, BlockInfo] = {}
        self.leaves: list[int] = []
        self.leaf_index: dict[int, int] = {}
        self.num_evictable = 0

    def priority(self, block_hash: int, now: float) -> tuple:
        raise NotImplementedError

    def stored(
        self, block_hash: int, parent: int | None, depth: int, is_prompt_tail: bool, now: float
    ) -> None:
        self.blocks[block_hash] = BlockInfo(parent, depth, is_prompt_tail, last_access_s=now)
        if parent is not None and (parent_info := self.blocks.get(parent)) is not None:
            parent_info.num_children += 1
            self._drop_leaf(parent)

    def hit(self, block_hash: int, now: float) -> None:
        info = self.blocks[block_hash]
        info.num_hits += 1
        info.last_access_s = now

    def released(self, block_hash: int, now: float) -> None:
        info = self.blocks[block_hash]
        info.evictable = True
        info.released_s = info.last_access_s = now
        self.num_evictable += 1
        if info.num_children == 0:
            self._add_leaf(block_hash)

    def acquired(self, block_hash: int, now: float) -> None:
        self.blocks[block_hash].evictable = False
        self.num_evictable -= 1
        self._drop_leaf(block_hash)

    def evict(self, now: float) -> int:
        return self._evict_leaf(now)[0]

    def demote(self, block_hash: int, now: float) -> None:
        # As if released long ago and never hit: last for recency, frequency and density.
        info = self.blocks.get(block_hash)
        if info is not None and info.evictable:
            info.last_access_s = info.released_s = info.score = 0.0
            info.num_hits = 0

    def _evict_leaf(self, now: float) -> tuple[int, BlockInfo]:
        # `evict`, with the victim's info for the policies that learn from their victims.
        leaves = self.leaves
        if not leaves:
            # No leaf but evictable blocks: their children are held outside the prefix
            # tree's rule (the engine's kept blocks). Any evictable block may go then.
            leaves = [block_hash for block_hash in self]
        if self.sample_size is None or len(leaves) <= self.sample_size:
            candidates = leaves
        else:
            candidates = self.rng.sample(leaves, self.sample_size)
        victim = min(candidates, key=lambda block_hash: self.priority(block_hash, now))
        self._drop_leaf(victim)
        info = self.blocks.pop(victim)
        self.num_evictable -= 1
        if info.parent is not None and (parent_info := self.blocks.get(info.parent)) is not None:
            parent_info.num_children -= 1
            if parent_info.num_children == 0 and parent_info.evictable:
                self._add_leaf(info.parent)
        return victim, info

    def __len__(self) -> int:
        return self.num_evictable

    def __contains__(self, block_hash: object) -> bool:
        info = self.blocks.get(cast(int, block_hash))  # any hashable may be looked up
        return info is not None and info.evictable

    def __iter__(self) -> Iterator[int]:
        return (block_hash for block_hash, info in self.blocks.items() if info.evictable)

    def _add_leaf(self, block_hash: int) -> None:
        self.leaf_index[block_hash] = len(self.leaves)
        self.leaves.append(block_hash)

    def _drop_leaf(self, block_hash: int) -> None:
        # O(1): move the last leaf into the removed one's slot.
        index = self.leaf_index.pop(block_hash, None)
        if index is None:
            return
        last = self.leaves.pop()
        if last != block_hash:
            self.leaves[index] = last
            self.leaf_index[last] = index


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
