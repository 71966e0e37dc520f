"""The block pool: every KV block, its ref count, its hash, and the eviction order.

A block is in exactly one of three states:
  - in use: ref_count > 0 (held by one or more running requests);
  - free and cached: ref_count == 0, still holds a hash, can be revived by a prefix hit;
  - free and empty: ref_count == 0, no hash.
Free blocks (cached or not) sit in one LRU queue; allocation takes from its front and
evicts the block's hash if it had one. Requests free their blocks tail first, so within a
prompt the tail is evicted before the head, which other prompts are likelier to share.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, KVBlock] = {}
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
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self.free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
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
        # A prefix hit: take cached blocks out of the free queue if nobody held them.
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def cache_block(
        self, block: KVBlock, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> bool:
        """Register a full, computed block under its hash; False if the hash is taken."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # same prefix computed twice concurrently; keep the first copy
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        if self.track_newly_cached:
            self.newly_cached.append(block)
        self._record(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size))
        return True

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
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
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
