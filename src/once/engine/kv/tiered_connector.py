"""KV tiers below the device pool: L2 host memory, L3 local disk, L4 a shared Redis.

    device pool --(evicted: write-back, or filled: write-through)--> host (L2)
    host --(write-through: as blocks fill; write-back: what host evicts)--> disk (L3)
    every filled block --(always written through)--> shared store (L4)

The shared store is written as blocks fill whatever the mode, since its purpose is a
replica that dies: blocks written only on eviction would die with it. So is a prefill
engine's transfer store (kv/disagg/transfer.py), read by decode engines through their peers.

Reading back goes through the host tier. A prefix hit in host memory is copied into the
device during scheduling (a memcpy, or an H2D copy from pinned memory). A prefix that
continues on disk or in the shared store is *prefetched*: the transfer thread reads each
block, checks it (block_codec), and puts it into the host tier; the request waits aside
meanwhile (the scheduler parks it, others run) and is then matched again, finding its
blocks in host memory. A block missing, torn or failing its checksum ends the run there:
the rest is recomputed.

Writes below the host run on a second thread from copies taken when the block was saved,
so the step loop pays one copy per block, never an encode or an I/O. When the writer is
`max_pending_writes` behind, new writes are dropped (counted): tiers must never slow the
step loop they exist to spare.
"""

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from once.engine.kv.block_codec import decode_block, encode_block
from once.engine.kv.connector import KVConnector
from once.engine.kv.disagg.peers import PeerSet
from once.engine.kv.disagg.transfer import TransferStore
from once.engine.kv.disk_tier import DiskTier
from once.engine.kv.host_tier import HostTier
from once.engine.kv.shared_tier import SharedTier
from once.protocol.kv_blocks import BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

WRITE_MODES = ("write_through", "write_back")
# The medium each tier's KV events carry (the device pool's own events say CPU or GPU).
MEDIUM = {"host": "HOST", "disk": "DISK", "shared": "SHARED", "transfer": "TRANSFER"}
_FIGURES = ("hit_blocks", "loaded_bytes", "load_time_s", "saved_blocks", "corrupt_blocks")


class TieredConnector(KVConnector):
    # Whether a transfer store among the tiers is written as blocks fill: a prefill
    # engine's own store is; a decode engine's peers are the prefill engines' (read only).
    writes_transfer = True

    def __init__(
        self,
        host: HostTier,
        fingerprint: bytes,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
        transfer: TransferStore | PeerSet | None = None,
        write_mode: str = "write_through",
        max_pending_writes: int = 4096,
        block_size: int = 16,
    ):
        if write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {write_mode!r}")
        self.host = host
        self.disk = disk
        self.shared = shared
        self.transfer = transfer
        # Below the host, beside disk: stores read on a miss, and those of them written as
        # blocks fill. The transfer store first: for a decode engine it is the prefill
        # engine's own copy, the direct path, where a shared store may hold the same blocks.
        self.remotes = [t for t in (transfer, shared) if t is not None]
        self.written_remotes = [
            t for t in self.remotes if t is not transfer or self.writes_transfer
        ]
        self.fingerprint = fingerprint
        self.write_mode = write_mode
        self.block_size = block_size
        self.max_pending_writes = max_pending_writes
        self.tiers = [t for t in (host, disk, shared, transfer) if t is not None]
        self.wants_new_blocks = write_mode == "write_through" or bool(self.written_remotes)
        self.wants_evicted = write_mode == "write_back"
        self.figures: dict[str, dict[str, float]] = {
            t.name: dict.fromkeys(_FIGURES, 0.0) for t in self.tiers
        }
        self.num_dropped_writes = 0
        self._pending_writes = 0
        self._lock = threading.Lock()  # figures, pending count, events
        self._events: list[KVEvent] = []
        self.record_events = False
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="once-kv-write")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="once-kv-load")
        # The loader's own staging block: promoted blocks are decoded into it.
        self._stage_k = torch.empty_like(host.k[0])
        self._stage_v = torch.empty_like(host.v[0])

    # -- what the engine asks ------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> int:
        return self.host.run_length(block_hashes)

    def save(self, block_hash: int, layers_k, layers_v) -> None:
        # A block just filled on the device.
        through = self.write_mode == "write_through"
        if through:
            self._put_host(block_hash, layers_k, layers_v)
        below = [t for t in (self.disk if through else None, *self.written_remotes)
                 if t is not None]  # fmt: skip
        if below:
            # One copy for the writer: the device block may be reused before it runs.
            k, v = layers_k.clone(), layers_v.clone()
            for tier in below:
                self._write_below(tier, block_hash, k, v)

    def evicted(self, block_hash: int, layers_k, layers_v) -> None:
        # Write-back: a block leaves the device pool with its K/V still intact.
        self._put_host(block_hash, layers_k, layers_v)

    def load(self, block_hash: int, layers_k, layers_v) -> bool:
        started = time.perf_counter()
        if not self.host.get(block_hash, layers_k, layers_v):
            return False
        self._count("host", hit_blocks=1, loaded_bytes=self.host.bytes_per_block,
                    load_time_s=time.perf_counter() - started)  # fmt: skip
        return True

    def prefetch(self, block_hashes: Sequence[int]) -> Future | None:
        """Start bringing `block_hashes` (a run the host tier lacks) up from disk or the
        shared store; None when neither could have the first of them."""
        if not block_hashes or (self.disk is None and not self.remotes):
            return None
        if not self.remotes and block_hashes[0] not in self.disk:  # type: ignore[operator]
            return None
        return self._loader.submit(self._promote, list(block_hashes))

    # -- the transfer threads -------------------------------------------------------------

    def release(self, block_hashes: Sequence[int]) -> None:
        """The waiting request has its prefetched run: unpin it in the host tier."""
        self.host.unpin(block_hashes)

    def _promote(self, block_hashes: list[int]) -> int:
        num_promoted = 0
        for block_hash in block_hashes:
            if block_hash in self.host:
                self.host.pin(block_hash)
                continue
            for tier in (self.disk, *self.remotes):
                if tier is None or (tier is self.disk and block_hash not in tier):
                    continue
                started = time.perf_counter()
                data = tier.get(block_hash)
                if data is None:
                    continue
                if not decode_block(
                    data, self.fingerprint, block_hash, self._stage_k, self._stage_v
                ):
                    tier.discard(block_hash)
                    self._count(tier.name, corrupt_blocks=1)
                    continue
                self._put_host(block_hash, self._stage_k, self._stage_v)
                self.host.pin(block_hash)
                self._count(tier.name, hit_blocks=1, loaded_bytes=len(data),
                            load_time_s=time.perf_counter() - started)  # fmt: skip
                num_promoted += 1
                break
            else:
                break  # in no tier: the rest of the run is recomputed
        return num_promoted

    def _put_host(self, block_hash: int, layers_k, layers_v) -> None:
        spill = self.write_mode == "write_back" and self.disk is not None
        was_there = block_hash in self.host
        evicted = self.host.put(block_hash, layers_k, layers_v, keep_evicted=spill)
        if not was_there:
            self._count("host", saved_blocks=1)
            self._event(BlockStored([block_hash], None, [], self.block_size, None, MEDIUM["host"]))
        for victim, k, v in evicted:
            self._event(BlockRemoved([victim], MEDIUM["host"]))
            if self.disk is not None and victim not in self.disk:
                self._write_below(self.disk, victim, k, v)

    def _write_below(self, tier, block_hash: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self._lock:
            if self._pending_writes >= self.max_pending_writes:
                self.num_dropped_writes += 1
                return
            self._pending_writes += 1
        self._writer.submit(self._write, tier, block_hash, k, v)

    def _write(self, tier, block_hash: int, k: torch.Tensor, v: torch.Tensor) -> None:
        try:
            if tier.put(block_hash, encode_block(self.fingerprint, block_hash, k, v)):
                self._count(tier.name, saved_blocks=1)
                self._event(BlockStored([block_hash], None, [], self.block_size, None,
                                        MEDIUM[tier.name]))  # fmt: skip
        except Exception:  # noqa: BLE001 - a failed write loses a copy, never the engine
            logger.exception("KV tier %s: write failed", tier.name)
        finally:
            with self._lock:
                self._pending_writes -= 1

    # -- accounting ------------------------------------------------------------------------

    def _count(self, tier: str, **amounts: float) -> None:
        with self._lock:
            figures = self.figures[tier]
            for key, amount in amounts.items():
                figures[key] += amount

    def _event(self, event: KVEvent) -> None:
        if self.record_events:
            with self._lock:
                self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        with self._lock:
            stats: dict = {
                f"kv_tier_{tier}_{key}": value
                for tier, figures in self.figures.items()
                for key, value in figures.items()
            }
            stats["kv_tier_pending_writes"] = self._pending_writes
            stats["kv_tier_dropped_writes"] = self.num_dropped_writes
        stats["kv_tier_host_blocks"] = len(self.host)
        stats["kv_tier_host_capacity_blocks"] = self.host.num_slots
        stats["kv_tier_host_evictions"] = self.host.num_evictions
        if self.disk is not None:
            stats["kv_tier_disk_blocks"] = len(self.disk)
            stats["kv_tier_disk_bytes"] = self.disk.num_bytes
            stats["kv_tier_disk_evictions"] = self.disk.num_evictions
        for remote in self.remotes:
            stats[f"kv_tier_{remote.name}_errors"] = remote.num_errors
        return stats

    def flush(self, loads: bool = False) -> None:
        """Wait for every write queued so far and, with `loads`, every load and release."""
        self._writer.submit(lambda: None).result()
        if loads:
            self._loader.submit(lambda: None).result()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        for remote in self.remotes:
            remote.close()
