"""The KV capacity of one simulated replica, in blocks, with a prefix cache and LRU eviction.

Blocks are of two kinds. Shared blocks carry a prefix hash: they are found by
`match_prefix`, counted by reference, and when no running request holds them they stay
cached in an LRU list until space is needed. Private blocks belong to one running request:
its prompt blocks until their prefill completes (then they are published as shared), its
output blocks, and duplicates of blocks another request published first. As in vLLM, a
finished request releases its shared blocks tail first, so a prompt's tail is evicted before
its head.

Invariant: num_used + len(lru) <= capacity, where num_used = len(refs) + num_private.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"KV capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # shared block hash -> running requests holding it
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.num_private = 0
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        return len(self.refs) + self.num_private

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` present in the cache."""
        refs, lru = self.refs, self.lru
        num = 0
        for block_hash in hashes:
            if block_hash not in refs and block_hash not in lru:
                break
            num += 1
        return num

    def can_admit(self, hashes: Sequence[int], num_matched: int, num_blocks: int) -> bool:
        # Matched blocks leave the LRU list (they become used); every cached block still in
        # the LRU list can be evicted to make room for the new ones.
        num_revived = sum(1 for h in hashes[:num_matched] if h in self.lru)
        return self.num_used + num_revived + (num_blocks - num_matched) <= self.capacity

    def admit(self, hashes: Sequence[int], num_matched: int, num_blocks: int) -> list[int]:
        """Reference the matched prefix and allocate the other blocks privately.

        Returns the shared hashes this request now holds (to release later)."""
        if not self.can_admit(hashes, num_matched, num_blocks):
            raise ValueError("admit() without room: call can_admit() first")
        held = list(hashes[:num_matched])
        for block_hash in held:
            if block_hash in self.lru:
                del self.lru[block_hash]
                self.refs[block_hash] = 1
            else:
                self.refs[block_hash] += 1
        self.num_private += num_blocks - num_matched
        self._evict_to_capacity()
        return held

    def publish(self, hashes: Sequence[int], held: list[int]) -> None:
        """Turn a request's computed prompt blocks (after its matched prefix) into shared
        blocks. A hash already cached (published meanwhile by another request) stays a
        private duplicate; so does every block after it, to keep prefixes chained."""
        for block_hash in hashes[len(held) :]:
            if block_hash in self.refs or block_hash in self.lru:
                return
            self.refs[block_hash] = 1
            self.num_private -= 1
            held.append(block_hash)

    def release(self, held: list[int], num_blocks: int) -> None:
        self.num_private -= num_blocks - len(held)
        for block_hash in reversed(held):
            count = self.refs[block_hash] - 1
            if count:
                self.refs[block_hash] = count
            else:
                del self.refs[block_hash]
                self.lru[block_hash] = None

    def _evict_to_capacity(self) -> None:
        while self.num_used + len(self.lru) > self.capacity and self.lru:
            self.lru.popitem(last=False)
            self.num_evictions += 1
