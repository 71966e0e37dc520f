"""KV cache manager: the three calls the scheduler makes (match_prefix, allocate, free).

Block table of a request, for block_size 4 and 10 tokens of which 6 are computed:

    tokens   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    blocks   [  block 7  ] [  block 2  ] [ block 9 ]
    hashed   h0 (full)     h1 (full)     - (partial: not cacheable yet)

A block is registered in the prefix cache as soon as it is full and the step that fills it
has been scheduled: the forward runs before any later request can match it.
"""

import time
from collections.abc import Callable, Sequence

from once.engine.kv.blocks import BlockPool, KVBlock
from once.engine.kv.connector import KVConnector, NoOpConnector
from once.engine.request import Request
from once.protocol.kv_blocks import extend_block_hashes, prompt_tail_hash


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        connector: KVConnector | None = None,
        load_block: Callable[[int, int], bool] | None = None,
        load_tail: Callable[[int, int], bool] | None = None,
    ):
        self.pool = pool
        self.block_size = pool.block_size
        self.connector = connector or NoOpConnector()
        # load_block(block_id, block_hash) copies a block from the connector into the
        # device cache; the engine supplies it because only it holds the KV tensors.
        self.load_block = load_block
        self.load_tail_block = load_tail  # (block_id, tail hash): a remote prompt tail
        self.has_connector = not isinstance(self.connector, NoOpConnector)
        if self.has_connector and load_block is None:
            raise ValueError("a KV connector needs load_block to copy its blocks in")
        pool.track_newly_cached = self.has_connector and self.connector.wants_new_blocks
        self.num_external_hit_tokens = 0
        self.num_prefetches = 0  # requests that waited for blocks from a slower tier
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Leading blocks of each request already offered to the prefix cache: each step
        # looks only at blocks that became full since, not the whole table.
        self.num_offered_blocks: dict[str, int] = {}
        self.num_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, found

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def match_prefix(
        self, request: Request, budget_tokens: int | None = None
    ) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the head of the request's tokens.

        At least one token is always left to compute: the last prompt position must run
        through the model to produce the logits of the first output token. Blocks loaded
        from a connector leave room for the first chunk the step's `budget_tokens` allows.
        """
        if not self.pool.enable_caching:
            return [], 0
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt
        )
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.get_cached_block(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        if self.has_connector and len(hits) < max_blocks:
            hits += self._load_external(request, hits, max_blocks, budget_tokens)
        return hits, len(hits) * self.block_size

    def _load_external(
        self, request: Request, hits: list[KVBlock], max_blocks: int, budget_tokens: int | None
    ) -> list[KVBlock]:
        # Device miss: ask the connector (host/disk tier, or a prefill node) for the next
        # run of blocks, copy them into fresh device blocks and cache them there. They are
        # released to ref 0 at once (cached, in the free queue) and taken like any hit.
        # A run that goes on in a slower tier (disk, a shared store) is first brought up
        # off the step loop: the request waits aside (request.kv_prefetch, see the
        # scheduler) and, matched again once it is back, loads it all from here.
        load_block = self.load_block
        assert load_block is not None  # __init__ requires it with a connector
        wanted = request.block_hashes[len(hits) : max_blocks]
        num_ready = self.connector.lookup(wanted)
        if num_ready < len(wanted) and request.kv_prefetch is None:
            future = self.connector.prefetch(wanted[num_ready:])
            if future is not None:
                request.kv_prefetch = future
                request.kv_prefetch_started = time.monotonic()
                self.num_prefetches += 1
                return []
        # The device hits are held while blocks are taken for the loads: a hit sitting in
        # the free queue must not be the block a load overwrites. Loads stop short of
        # the request's first chunk, so what they bring in can be used at once, and
        # never evict the cache for a request that then does not fit.
        if num_ready == 0:
            return []
        self.pool.touch(hits)
        num_free = self.pool.num_free_blocks
        num_left = -(-request.num_tokens // self.block_size) - len(hits)  # blocks it needs
        if budget_tokens is not None and num_left + 1 > num_free:
            # It will not fit whole: load only what leaves a full chunk's room.
            num_free -= -(-budget_tokens // self.block_size) + 1
        num_available = min(num_ready, num_free)
        loaded: list[KVBlock] = []
        for i, block in enumerate(self.pool.get_new_blocks(max(0, num_available))):
            index = len(hits) + i
            tokens = request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
            parent = request.block_hashes[index - 1] if index else None
            if len(loaded) != i or not load_block(block.block_id, wanted[i]):
                self.pool.free_blocks([block])
                continue
            self.pool.cache_block(block, wanted[i], parent, tokens)
            loaded.append(block)
        self.pool.free_blocks(reversed(loaded))
        self.pool.free_blocks(reversed(hits))
        if request.kv_prefetch is not None and request.kv_prefetch_settled:
            self.connector.release(wanted)  # pinned by the prefetch, copied (or not) now
        # Blocks that came from the connector need not be saved back to it.
        self.pool.newly_cached = [b for b in self.pool.newly_cached if b not in loaded]
        self.num_external_hit_tokens += len(loaded) * self.block_size
        return loaded

    def load_tail(self, request: Request, num_hit_tokens: int) -> int:
        """After `allocate`: the prompt's partial last block, from a prefill engine, into
        the request's own block past its hits; the tokens it covers (0: none loaded)."""
        tail = prompt_tail_hash(request.block_hashes, request.prompt_token_ids,
                                self.block_size, request.cache_salt)  # fmt: skip
        blocks = self.req_blocks.get(request.request_id, [])
        index = num_hit_tokens // self.block_size
        if tail is None or self.load_tail_block is None or num_hit_tokens % self.block_size:
            return 0
        tail_hash, num_tail = tail
        if index >= len(blocks) or num_hit_tokens + num_tail != request.num_prompt_tokens - 1:
            return 0  # the full blocks before the tail did not all come
        if not self.load_tail_block(blocks[index].block_id, tail_hash):
            return 0
        self.num_external_hit_tokens += num_tail
        return num_tail

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def can_allocate(
        self, request: Request, num_new_tokens: int, hit_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, hit_blocks) <= (
            self.pool.num_free_blocks - sum(1 for b in hit_blocks if b.ref_count == 0)
        )

    def allocate(
        self, request: Request, num_new_tokens: int, hit_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if short."""
        if not self.can_allocate(request, num_new_tokens, hit_blocks):
            return False
        num_needed = self._num_blocks_needed(request, num_new_tokens, hit_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if hit_blocks:
            self.pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
        if num_needed:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        num_prior = request.num_computed_tokens + len(hit_blocks) * self.block_size
        self._cache_full_blocks(request, num_prior + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_offered_blocks.pop(request.request_id, None)
        # Tail first: the end of a prompt is the least likely part to be shared.
        self.pool.free_blocks(reversed(blocks))

    def trim(self, request: Request) -> None:
        """Roll back blocks past the request's computed tokens (rejected drafts' K/V).

        Blocks past them hold only drafted positions, never registered in the prefix
        cache, so they return to the pool as empty blocks; the rejected K/V left inside
        the last kept block is overwritten when those positions are computed again.
        """
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        num_keep = -(-request.num_computed_tokens // self.block_size)
        if len(blocks) > num_keep:
            extra = blocks[num_keep:]
            del blocks[num_keep:]
            self.pool.free_blocks(reversed(extra))

    def _num_blocks_needed(self, request, num_new_tokens, hit_blocks) -> int:
        num_held = len(self.req_blocks.get(request.request_id, ())) + len(hit_blocks)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if hit_blocks:
            num_tokens += len(hit_blocks) * self.block_size
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.pool.enable_caching:
            return
        blocks = self.req_blocks[request.request_id]
        # Only committed tokens: drafted positions beyond them may yet be rejected.
        num_committed = min(num_tokens_after_step, request.num_tokens)
        num_full = min(num_committed // self.block_size, len(blocks))
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids[: num_full * self.block_size],
            self.block_size,
            request.cache_salt,
        )
        first = self.num_offered_blocks.get(request.request_id, 0)
        self.num_offered_blocks[request.request_id] = max(first, num_full)
        for i in range(first, num_full):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            parent = request.block_hashes[i - 1] if i else None
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent_held = i == 0 or blocks[i - 1].block_hash == parent
            self.pool.cache_block(block, request.block_hashes[i], parent, tokens, parent_held)
