"""The contract of a KV block cache's eviction policy, LRU, and the base of the
prefix-aware policies (the others are in `once.kv_eviction.policies`).

One home for the engine's device pool (engine/kv/blocks.py), its host tier
(engine/kv/host_tier.py) and the simulator's caches (once.sim.kvcache, once.sim.tiers): the
same policy objects run in all of them, so the simulator's eviction is the engine's.
Torch-free; imports nothing from the layers that use it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast


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
