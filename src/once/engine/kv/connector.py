"""The KVConnector seam: save and load KV blocks by hash, outside the device pool.

One interface serves KV tiers (device -> host -> disk) and prefill/decode disaggregation
(a prefill node saves, a decode node loads). The engine calls it at two points: after a
block is computed and cached (`save`), and when a prefix lookup misses the device pool
(`load` of the longest run of hashes the connector holds). The no-op connector holds
nothing, which is exactly the engine without tiers.

Tiers (tiered_connector.py) use the optional rest: `evicted` for write-back (a block
leaving the device pool, K/V still intact), `prefetch` to bring a run up from a slower
tier off the step loop (the request waits aside until the future is done), per-tier
`stats` and KV events with their medium.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future


class KVConnector(ABC):
    # Which device-pool moments it hears of: blocks as they fill (`save`), blocks as they
    # are evicted (`evicted`).
    wants_new_blocks = True
    wants_evicted = False
    record_events = False

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

    def stats(self) -> dict:
        return {}

    def take_events(self) -> list:
        return []

    def close(self) -> None:
        return None


class NoOpConnector(KVConnector):
    def lookup(self, block_hashes: Sequence[int]) -> int:
        return 0

    def save(self, block_hash: int, layers_k, layers_v) -> None:
        return None

    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        return False
