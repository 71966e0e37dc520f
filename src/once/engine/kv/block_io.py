"""Block I/O: where a block's K/V sits in the paged KV cache, for the copies between the
cache and a connector (issue 30: block I/O in one place, out of the engine's step loop).

A block's K (or V) across layers is the cache's [:, block_id]: (num_layers, block_size,
kv_heads, head_dim). The connector (connector.py) copies through these views: blocks the
step made whole, a finished prompt's partial last block (for a decode engine), evicted
blocks (write-back tiers), and loads back into a slot. Session pauses read blocks by hash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from once.engine.attention import PagedKVCache
from once.engine.kv.blocks import BlockPool
from once.engine.request import Request
from once.protocol.kv_blocks import prompt_tail_hash


class BlockIO:
    def __init__(
        self,
        kv_cache: PagedKVCache,
        pool: BlockPool,
        block_ids: Callable[[str], list[int]],  # a request's block table (KVCacheManager)
    ):
        self.kv_cache = kv_cache
        self.pool = pool
        self.block_ids = block_ids

    def slot(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.k[:, block_id], self.kv_cache.v[:, block_id]

    def take_new_blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(hash, K, V) of the blocks registered while scheduling this step: their K/V is
        computed now."""
        for block in self.pool.take_newly_cached():
            assert block.block_hash is not None  # newly cached blocks are full, so hashed
            yield (block.block_hash, *self.slot(block.block_id))

    def prompt_tails(
        self, scheduled: Sequence
    ) -> Iterator[tuple[Request, int, torch.Tensor, torch.Tensor]]:
        """(request, tail hash, K, V) of each prompt that finishes its prefill this step
        with a partial last block (protocol.kv_blocks.prompt_tail_hash)."""
        for item in scheduled:
            request = item.request
            if request.output_token_ids or request.num_computed_tokens + item.num_new_tokens < (
                request.num_prompt_tokens
            ):
                continue
            tail = prompt_tail_hash(request.block_hashes, request.prompt_token_ids,
                                    self.pool.block_size, request.cache_salt)  # fmt: skip
            block_ids = self.block_ids(request.request_id)
            index = (request.num_prompt_tokens - 1) // self.pool.block_size
            if tail is not None and index < len(block_ids):
                yield (request, tail[0], *self.slot(block_ids[index]))

    def read_block(self, block_hash: int):
        block = self.pool.cached.get(block_hash)
        return None if block is None else self.slot(block.block_id)
