"""The block pool: every KV block, its ref count, its hash, and the eviction order.

A block is in exactly one of four states:
  - in use: ref_count > 0 (held by one or more running requests);
  - free and empty: ref_count == 0, no hash; allocation takes these first, oldest first;
  - free and cached: ref_count == 0, still holds a hash, can be revived by a prefix hit;
    which one is evicted when no empty block is left is the `EvictionPolicy`'s choice,
    the same policy objects the simulator and the host tier run (once.kv_eviction);
    LRU by default, as in vLLM;
  - kept: free and cached, but its session said it pauses for a short tool (a hint,
    `keep`): out of the policy's reach until its deadline passes. When nothing else is
    free, the session expected back last loses its keep first (its blocks go to the
    policy), so a hint never makes a request wait.
Requests free their blocks tail first, so under LRU a prompt's tail is evicted before its
head, which other prompts are likelier to share.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from once.kv_eviction.base import LRU, EvictionPolicy
from once.protocol.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # checked on every hit

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        policy_factory: Callable[[], EvictionPolicy] = LRU,
        clock: Callable[[], float] = time.monotonic,
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.empty: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.policy_factory = policy_factory
        self.policy = policy_factory()
        self.clock = clock
        self.cached: dict[int, KVBlock] = {}
        # Keeps: block hash -> (when the keep lapses, when the block is expected to be
        # used) for every hinted block, and the free ones among them, out of the policy.
        self.keep_until: dict[int, tuple[float, float]] = {}
        self.kept: dict[int, None] = {}  # in the order they were kept, head first
        self.num_keeps_broken = 0  # kept blocks released early, for room
        # KV events are kept only once a consumer asked for them (a router's exact index,
        # a publisher): nobody would drain them otherwise, and they would grow forever.
        self.record_events = False
        self.events: list[KVEvent] = []
        self.num_evictions = 0
        # Blocks registered since the last take_newly_cached(): the engine hands them to
        # its KVConnector once the forward that fills them has run.
        self.track_newly_cached = False
        self.newly_cached: list[KVBlock] = []
        # Called with a cached block about to lose its hash, K/V still intact (the
        # write-back of KV tiers).
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.policy) + len(self.kept)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def free_queue(self) -> list[int]:
        """Free block ids, empty ones first (in the order they are taken), then cached."""
        return [*self.empty, *(self.cached[h].block_id for h in self.policy), *(
            self.cached[h].block_id for h in self.kept
        )]  # fmt: skip

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            if self.empty:
                block = self.empty.popitem(last=False)[1]
            else:
                if len(self.policy) == 0:
                    self._release_keeps()
                block = self.cached[self.policy.evict(self.clock())]
                self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None  # a miss, or a 64-bit hash collision caught by the token check
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        # A prefix hit: take cached blocks out of the free set if nobody held them. A hit
        # on a kept block ends its keep: its session is back.
        now = self.clock()
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                self.policy.hit(block_hash, now)
            if block.ref_count == 0:
                if block_hash is None:
                    del self.empty[block.block_id]
                elif block_hash in self.kept:
                    del self.kept[block_hash]
                else:
                    self.policy.acquired(block_hash, now)
            if block_hash is not None:
                self.keep_until.pop(block_hash, None)
            block.ref_count += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        now = self.clock()
        for block in blocks_in_eviction_order:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.block_hash is None:
                self.empty[block.block_id] = block
            elif self.keep_until.get(block.block_hash, (0.0, 0.0))[0] > now:
                self.kept[block.block_hash] = None
            else:
                self.keep_until.pop(block.block_hash, None)
                self.policy.released(block.block_hash, now)

    def cache_block(
        self,
        block: KVBlock,
        block_hash: int,
        parent_hash: int | None,
        token_ids: Sequence[int],
        parent_held: bool = True,
    ) -> bool:
        """Register a full, computed block under its hash; False if the hash is taken.

        parent_held: the request holds the cached block of `parent_hash` (not a duplicate
        of it), so while the child is held the parent is too."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # same prefix computed twice concurrently; keep the first copy
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        # The policy's tree links a block to a parent that its request holds: a
        # prefix-aware policy evicts leaves only, so a held child's parent must be held.
        lineage_parent = parent_hash if parent_held and parent_hash in self.cached else None
        depth = 0 if lineage_parent is None else self._depth(block_hash, lineage_parent)
        self.policy.stored(block_hash, lineage_parent, depth, False, self.clock())
        if block.ref_count == 0:  # a block cached while free (never, today): evictable
            self.policy.released(block_hash, self.clock())
        if self.track_newly_cached:
            self.newly_cached.append(block)
        self._record(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size))
        return True

    def keep(
        self, block_hashes: Sequence[int], until: float, needed_at: float | None = None
    ) -> int:
        """Keep the leading cached run of a session's blocks out of eviction until `until`;
        `needed_at` (default `until`): when the session is expected to use them, which
        orders keeps when one must be broken. How many blocks were kept."""
        now = self.clock()
        needed = until if needed_at is None else needed_at
        count = 0
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break  # what follows a missing block is unreachable
            old_until, old_needed = self.keep_until.get(block_hash, (0.0, needed))
            if old_until <= now:
                old_needed = needed  # a lapsed keep counts for nothing
            # A block shared by sessions: kept for the longest, needed by the soonest.
            self.keep_until[block_hash] = (max(until, old_until), min(needed, old_needed))
            if block.ref_count == 0 and block_hash not in self.kept:
                self.policy.acquired(block_hash, now)
                self.kept[block_hash] = None
            count += 1
        return count

    def demote(self, block_hashes: Sequence[int]) -> int:
        """Make a session's free cached blocks the first to be evicted, its tail first (a
        long pause: they wait in a lower tier); how many were demoted."""
        now = self.clock()
        count = 0
        for block_hash in block_hashes:  # head to tail: the tail ends up first in line
            block = self.cached.get(block_hash)
            if block is None:
                break
            self.keep_until.pop(block_hash, None)
            if block_hash in self.policy:
                self.policy.demote(block_hash, now)
                count += 1
        return count

    def _release_keeps(self) -> None:
        # Nothing empty or evictable: kept blocks whose keep lapsed go to the policy, and
        # if none did, the keep of the session expected to need its blocks last.
        now = self.clock()
        keeps = self.keep_until
        expired = [h for h in self.kept if keeps[h][0] <= now]
        if not expired:
            last = max(keeps[h][1] for h in self.kept)
            expired = [h for h in self.kept if keeps[h][1] == last]
            self.num_keeps_broken += len(expired)
        for block_hash in reversed(expired):  # kept head first: released tail first
            del self.kept[block_hash]
            del keeps[block_hash]
            self.policy.released(block_hash, now)

    def _depth(self, block_hash: int, parent_hash: int) -> int:
        info = getattr(self.policy, "blocks", {}).get(parent_hash)
        return info.depth + 1 if info is not None else 1

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            if self.on_evict is not None:
                self.on_evict(block)
            del self.cached[block.block_hash]
            self._record(BlockRemoved([block.block_hash]))
            self.num_evictions += 1
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        if self.num_used_blocks:
            return False  # blocks in use may be shared; only an idle pool can be cleared
        for block in self.blocks:
            if block.block_hash is not None:
                self.empty[block.block_id] = block
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self.kept.clear()
        self.keep_until.clear()
        self.policy = self.policy_factory()
        self._record(AllBlocksCleared())
        return True

    def take_newly_cached(self) -> list[KVBlock]:
        blocks, self.newly_cached = self.newly_cached, []
        return blocks

    def _record(self, event: KVEvent) -> None:
        if self.record_events:
            self.events.append(event)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
