"""The KVConnector seam: KV blocks by hash outside the device pool, and the request
lifecycle the engine drives through it.

One connector object has two faces, as vLLM v1's has a scheduler side and a worker side:

- the block store, which the KV manager, the pool and session pauses call: `lookup` (how
  long a run of hashes it can load), `save` (a block just computed and cached), `load`
  (into a device block), and optionally `evicted` (write-back: a block leaving the device
  pool, K/V intact), `prefetch` (bring a run up from a slower tier off the step loop; the
  request waits aside until the future is done) and `release`;
- the lifecycle, which the engine calls and nothing else:

      register_kv_cache(blocks)        once: the device cache's block I/O (block_io.py)
      on_arrival(request) -> request   the request as this engine runs it
      on_admit(state, params)          what the connector will supply to it
      after_forward(scheduled)         the step's blocks are computed: save, hand off
      on_finish(state) -> params       the request is done: its kv_transfer_params
      stats(), take_events(), close()

Every feature is a connector class: `NoOpConnector` (nothing: the engine without tiers),
`TieredConnector` (host, disk, shared store), `PrefillConnector` and `DecodeConnector`
(tiers plus a transfer store or its peers; kv/disagg/role.py), built from the config in
one place (tier_setup.py). `HostMemoryConnector` is the smallest real one and the tests'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from once.engine.kv.block_io import BlockIO
    from once.engine.kv.blocks import KVBlock
    from once.engine.request import Request
    from once.protocol.engine import GenerateRequest


class ScheduledItem(Protocol):
    # A request the step ran and its tokens this step (scheduler.ScheduledRequest).
    request: Request
    num_new_tokens: int


class KVConnector(ABC):
    # Which device-pool moments it hears of: blocks as they fill (`save`), blocks as they
    # are evicted (`evicted`).
    wants_new_blocks = True
    wants_evicted = False
    record_events = False
    role = "both"  # the engine's prefill/decode role this connector plays
    block_io: BlockIO | None = None

    # -- the block store -------------------------------------------------------------------

    @abstractmethod
    def lookup(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` this connector can load."""

    @abstractmethod
    def save(self, block_hash: int, layers_k, layers_v) -> None:
        """Keep a copy of one block's K/V (per layer) under its hash."""

    @abstractmethod
    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        """Copy the block's K/V into the given per-layer tensors; False if gone."""

    def evicted(self, block_hash: int, layers_k, layers_v) -> None:
        """A cached block is leaving the device pool (only when `wants_evicted`)."""
        return None

    def prefetch(self, block_hashes: Sequence[int]) -> Future | None:
        """Start making more of `block_hashes` loadable; None when there is nothing to
        wait for."""
        return None

    def release(self, block_hashes: Sequence[int]) -> None:
        """A prefetched run has been loaded (or given up): it need not be held."""
        return None

    # -- the device cache's side: copies between a device block and the store ----------------

    def register_kv_cache(self, block_io: BlockIO) -> None:
        self.block_io = block_io

    def _io(self) -> BlockIO:
        if self.block_io is None:
            raise RuntimeError("the connector has no KV cache: register_kv_cache() first")
        return self.block_io

    def load_block(self, block_id: int, block_hash: int) -> bool:
        """Copy the stored block into device block `block_id` (the KV manager's loads)."""
        return self.load(block_hash, *self._io().slot(block_id))

    def load_tail(self, block_id: int, tail_hash: int) -> bool:
        """Copy a prompt's partial last block from a prefill engine into `block_id`."""
        return False

    def offload_evicted(self, block: KVBlock) -> None:
        """The pool's eviction callback, for write-back (`wants_evicted`)."""
        assert block.block_hash is not None  # called before the block loses its hash
        self.evicted(block.block_hash, *self._io().slot(block.block_id))

    # -- the request lifecycle -------------------------------------------------------------

    def on_arrival(self, request: GenerateRequest) -> GenerateRequest:
        """The request as this engine runs it (may raise an API error)."""
        return request

    def on_admit(self, request: Request, kv_transfer_params: dict | None) -> None:
        """A request joined the engine; mark on it what this connector will supply."""
        return None

    def after_forward(self, scheduled: Sequence[ScheduledItem]) -> None:
        """The step's forward has run: blocks it made whole hold their K/V now."""
        for block_hash, k, v in self._io().take_new_blocks():
            self.save(block_hash, k, v)

    def on_finish(self, request: Request) -> dict | None:
        """The request is done (finished, aborted or failed): the `kv_transfer_params`
        its last delta carries, if any."""
        return None

    def stats(self) -> dict:
        return {}

    def take_events(self) -> list:
        return []

    def close(self) -> None:
        return None


class NoOpConnector(KVConnector):
    wants_new_blocks = False

    def lookup(self, block_hashes: Sequence[int]) -> int:
        return 0

    def save(self, block_hash: int, layers_k, layers_v) -> None:
        return None

    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        return False

    def after_forward(self, scheduled: Sequence[ScheduledItem]) -> None:
        return None
