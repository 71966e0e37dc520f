"""A KVConnector that keeps blocks in host memory, LRU-bounded.

The simplest real tier below the device pool: what the device evicts can come back by
hash without recompute, and two engines in one process can share it (the shape of
prefill/decode disaggregation, minus the transport). Also the fake that tests the seam.
"""

from collections import OrderedDict
from collections.abc import Sequence

from once.engine.kv.connector import KVConnector


class HostMemoryConnector(KVConnector):
    def __init__(self, max_blocks: int = 4096):
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[int, tuple] = OrderedDict()
        self.num_saved = 0
        self.num_loaded = 0

    def lookup(self, block_hashes: Sequence[int]) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.blocks:
                break
            count += 1
        return count

    def save(self, block_hash: int, layers_k, layers_v) -> None:
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return
        self.blocks[block_hash] = (layers_k.clone(), layers_v.clone())
        self.num_saved += 1
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        stored = self.blocks.get(block_hash)
        if stored is None:
            return False
        layers_k.copy_(stored[0])
        layers_v.copy_(stored[1])
        self.blocks.move_to_end(block_hash)
        self.num_loaded += 1
        return True
