"""The KVConnector seam: save and load KV blocks by hash, outside the device pool.

One interface serves KV tiers (device -> host -> disk) and prefill/decode disaggregation
(a prefill node saves, a decode node loads). The engine calls it at two points: after a
block is computed and cached (`save`), and when a prefix lookup misses the device pool
(`load` of the longest run of hashes the connector holds). The no-op connector holds
nothing, which is exactly the engine without tiers.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence


class KVConnector(ABC):
    @abstractmethod
    def lookup(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` this connector can load."""

    @abstractmethod
    def save(self, block_hash: int, layers_k, layers_v) -> None:
        """Keep a copy of one block's K/V (per layer) under its hash."""

    @abstractmethod
    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        """Copy the block's K/V into the given per-layer tensors; False if gone."""


class NoOpConnector(KVConnector):
    def lookup(self, block_hashes: Sequence[int]) -> int:
        return 0

    def save(self, block_hash: int, layers_k, layers_v) -> None:
        return None

    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        return False
