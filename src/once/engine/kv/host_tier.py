"""L2: a bounded pool of KV block slots in host memory, below the engine's block pool.

Slots are allocated once, up front (pinned on CUDA so device<->host copies can overlap
compute), and each holds one block's K and V for every layer. A slot is found by block
hash; which block leaves when the pool is full is the `EvictionPolicy`'s choice, the same
policy objects the simulator runs (once.kv_eviction), so a policy is
measured and served by one piece of code. Every host block is evictable: nothing holds a
slot between calls.

Two threads use the pool: the step loop (saves, loads into the device) and the transfer
thread (blocks promoted from disk or the shared store; blocks read to be written below).
One lock guards the index and the slots; a copy in or out happens under it.

Blocks promoted from a lower tier for a waiting request are pinned (not evictable) until
that request has copied them into the device, or `PIN_S` at most: the host tier is the
lower tiers' staging area, and without pins the blocks saved meanwhile by running
requests could push a promoted run out before it is used.
"""

import threading
import time
from collections.abc import Sequence

import torch

from once.kv_eviction.base import LRU, EvictionPolicy

Evicted = tuple[int, torch.Tensor, torch.Tensor]  # (block hash, K copy, V copy)
PIN_S = 10.0


class HostTier:
    name = "host"

    def __init__(
        self,
        num_slots: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        pin_memory: bool = False,
        policy: EvictionPolicy | None = None,
    ):
        if num_slots < 1:
            raise ValueError("the host KV tier needs at least one slot")
        shape = (num_slots, *block_shape)
        self.k = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        self.v = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        self.num_slots = num_slots
        self.bytes_per_block = 2 * self.k[0].numel() * self.k.element_size()
        self.slot_of: dict[int, int] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.policy = policy or LRU()
        self.lock = threading.Lock()
        self.num_evictions = 0
        self.num_refused = 0  # puts with every slot pinned
        self.pinned: dict[int, float] = {}  # block hash -> when its pin lapses

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.slot_of

    def run_length(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` are here."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.slot_of:
                break
            count += 1
        return count

    def put(
        self,
        block_hash: int,
        k: torch.Tensor,
        v: torch.Tensor,
        parent: int | None = None,
        depth: int = 0,
        keep_evicted: bool = False,
    ) -> list[Evicted]:
        """Copy one block in (refreshing it if present); the blocks pushed out, copied
        first, when `keep_evicted` (write-back to the tier below)."""
        now = time.monotonic()
        evicted: list[Evicted] = []
        with self.lock:
            slot = self.slot_of.get(block_hash)
            if slot is not None:
                self._touch(block_hash, now)
                return evicted
            if not self.free_slots and len(self.policy) == 0:
                self._expire_pins(now)
            if not self.free_slots and len(self.policy) == 0:
                self.num_refused += 1  # every slot pinned: this block is not kept
                return evicted
            if not self.free_slots:
                victim = self.policy.evict(now)
                victim_slot = self.slot_of.pop(victim)
                self.num_evictions += 1
                if keep_evicted:
                    k_copy, v_copy = self.k[victim_slot].clone(), self.v[victim_slot].clone()
                    evicted.append((victim, k_copy, v_copy))
                self.free_slots.append(victim_slot)
            slot = self.free_slots.pop()
            self.k[slot].copy_(k)
            self.v[slot].copy_(v)
            self.slot_of[block_hash] = slot
            self.policy.stored(block_hash, parent, depth, False, now)
            self.policy.released(block_hash, now)
        return evicted

    def get(self, block_hash: int, k_out: torch.Tensor, v_out: torch.Tensor) -> bool:
        with self.lock:
            slot = self.slot_of.get(block_hash)
            if slot is None:
                return False
            k_out.copy_(self.k[slot], non_blocking=self.k.is_pinned())
            v_out.copy_(self.v[slot], non_blocking=self.v.is_pinned())
            self._touch(block_hash, time.monotonic())
        return True

    def read(self, block_hash: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copies of a block's K and V (for a write to the tier below), or None if gone."""
        with self.lock:
            slot = self.slot_of.get(block_hash)
            if slot is None:
                return None
            return self.k[slot].clone(), self.v[slot].clone()

    def pin(self, block_hash: int) -> None:
        with self.lock:
            if block_hash in self.slot_of and block_hash not in self.pinned:
                self.policy.acquired(block_hash, time.monotonic())
                self.pinned[block_hash] = time.monotonic() + PIN_S

    def unpin(self, block_hashes) -> None:
        with self.lock:
            now = time.monotonic()
            for block_hash in block_hashes:
                if self.pinned.pop(block_hash, None) is not None:
                    self.policy.released(block_hash, now)

    def _expire_pins(self, now: float) -> None:
        for block_hash in [h for h, until in self.pinned.items() if until <= now]:
            del self.pinned[block_hash]
            self.policy.released(block_hash, now)

    def _touch(self, block_hash: int, now: float) -> None:
        # A hit makes a block recent again: held for the copy, released at once.
        self.policy.hit(block_hash, now)
        if block_hash not in self.pinned:
            self.policy.acquired(block_hash, now)
            self.policy.released(block_hash, now)
