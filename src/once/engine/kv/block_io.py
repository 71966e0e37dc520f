"""Copying blocks between the paged KV cache and a connector (issue 30: block I/O in one
place, out of the engine's step loop).

Each method moves one block's K/V, shaped (num_layers, block_size, kv_heads, head_dim),
between the cache's slot `block_id` and the connector: saving blocks this step made
whole, a finished prompt's partial last block (for a decode engine), evicted blocks
(write-back tiers), and loading a block or a prompt tail back into a slot. The pool, the
KV manager and session pauses call these as their callbacks.
"""

from __future__ import annotations

from once.engine.attention import PagedKVCache
from once.engine.kv.block_codec import decode_block
from once.engine.kv.blocks import BlockPool
from once.engine.kv.connector import KVConnector
from once.engine.kv.tiered_connector import TieredConnector
from once.protocol.kv_blocks import prompt_tail_hash


class BlockIO:
    def __init__(self, kv_cache: PagedKVCache, pool: BlockPool, connector: KVConnector | None):
        self.kv_cache = kv_cache
        self.pool = pool
        self.connector = connector

    def tiers(self) -> TieredConnector:
        # A prefill or decode role always builds tiers (EngineConfig.has_kv_tiers).
        assert isinstance(self.connector, TieredConnector)
        return self.connector

    def slot(self, block_id: int):
        return self.kv_cache.k[:, block_id], self.kv_cache.v[:, block_id]

    def save_new_blocks(self) -> None:
        # Blocks registered while scheduling this step now hold their computed K/V.
        assert self.connector is not None  # the engine saves only with a connector
        for block in self.pool.take_newly_cached():
            assert block.block_hash is not None  # newly cached blocks are full, so hashed
            self.connector.save(block.block_hash, *self.slot(block.block_id))

    def save_prompt_tails(self, scheduled, kv) -> None:
        # A prompt finishing its prefill this step: its partial last block goes to the
        # transfer store beside the full ones (protocol.kv_blocks.prompt_tail_hash).
        for item in scheduled:
            request = item.request
            if request.output_token_ids or request.num_computed_tokens + item.num_new_tokens < (
                request.num_prompt_tokens
            ):
                continue
            tail = prompt_tail_hash(request.block_hashes, request.prompt_token_ids,
                                    self.pool.block_size, request.cache_salt)  # fmt: skip
            block_ids = kv.block_ids(request.request_id)
            index = (request.num_prompt_tokens - 1) // self.pool.block_size
            if tail is not None and index < len(block_ids):
                self.tiers().save_to_transfer(tail[0], *self.slot(block_ids[index]))
                request.kv_prompt_tail_hash = tail[0]

    def load_tail(self, block_id: int, tail_hash: int) -> bool:
        connector = self.tiers()
        data = connector.transfer.get(tail_hash) if connector.transfer is not None else None
        k, v = self.slot(block_id)
        return decode_block(data, connector.fingerprint, tail_hash, k, v)

    def offload_evicted(self, block) -> None:
        assert self.connector is not None  # the pool calls back only with a connector
        self.connector.evicted(block.block_hash, *self.slot(block.block_id))

    def read_block(self, block_hash: int):
        block = self.pool.cached.get(block_hash)
        return None if block is None else self.slot(block.block_id)

    def load_block(self, block_id: int, block_hash: int) -> bool:
        assert self.connector is not None  # the manager loads only with a connector
        return self.connector.load(block_hash, *self.slot(block_id))
