"""Session-aware KV: what the engine does with a session's blocks while its agent runs a tool.

The gateway learns, when a response ends in a tool call, how long the harness expects
that tool to take (the harness's own running estimate per tool, sent as request metadata:
protocol/pause_hints.py; the gateway reads it in gateway/pause_hints.py), and tells the
engine `pause(session_key, expected_s)`. The engine remembers, per session, the block
hashes of its last finished request (its prompt and output: the prefix of the session's
next call), and then:

- a short pause (expected_s <= keep_s): the blocks are kept in the device pool until
  `expected_s x KEEP_SLACK + KEEP_MARGIN_S` from now; evictions take every other free
  block first (BlockPool.keep), and the next call's prefix hit ends the keep;
- a long pause: the blocks are offloaded to the KV tiers at once (write-back mode: they
  would otherwise go down only when evicted), demoted to the front of the device pool's
  eviction order, so running sessions keep their own blocks, and `PREFETCH_LEAD_S` before
  the pause is expected to end, the part of the run that sits below host memory is
  prefetched back into it; the next call loads it from there.

When the next call of a hinted session arrives, its blocks are kept (WAITING_KEEP_S at
most) until it is admitted: a pool under pressure would otherwise evict the prefix of a
request while it waits in the queue for room.

Sessions without hints are left to the eviction policy, as before.
"""

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from once.engine.kv.blocks import BlockPool
from once.engine.kv.connector import KVConnector

KEEP_SLACK = 2.0  # a tool's time varies: keep for twice the estimate ...
KEEP_MARGIN_S = 1.0  # ... plus the time to send the next request
PREFETCH_LEAD_S = 1.0
MAX_SESSIONS = 4096  # sessions remembered, least recently finished forgotten first
WAITING_KEEP_S = 30.0  # a returned session's blocks are kept this long for its admission

# (block hash, K of every layer, V of every layer) of one device block.
BlockReader = Callable[[int], tuple[object, object] | None]


class SessionPauses:
    def __init__(
        self,
        pool: BlockPool,
        connector: KVConnector | None,
        read_block: BlockReader,
        keep_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self.connector = connector
        self.read_block = read_block
        self.keep_s = keep_s
        self.clock = clock
        self.last_blocks: OrderedDict[str, list[int]] = OrderedDict()
        self.due: list[tuple[float, str]] = []  # (when to prefetch, session), a heap
        self.hinted: set[str] = set()  # sessions paused on a hint, not back yet
        self.counters = dict.fromkeys(
            ["kv_pause_hints", "kv_pause_kept_blocks", "kv_pause_offloaded_blocks",
             "kv_pause_demoted_blocks", "kv_pause_prefetches", "kv_pause_unknown_sessions"],
            0,
        )  # fmt: skip

    def finished(self, session_key: str | None, block_hashes: Sequence[int]) -> None:
        """A request of the session finished: its blocks are the next call's prefix."""
        if not session_key or not block_hashes:
            return
        self.last_blocks[session_key] = list(block_hashes)
        self.last_blocks.move_to_end(session_key)
        while len(self.last_blocks) > MAX_SESSIONS:
            self.last_blocks.popitem(last=False)

    def arrived(self, session_key: str | None) -> None:
        """The next call of a hinted session is here: its blocks are kept while it waits
        for admission, whose prefix hit ends the keep (and the hint)."""
        if not session_key or session_key not in self.hinted:
            return
        self.hinted.discard(session_key)
        hashes = self.last_blocks.get(session_key)
        if hashes:
            now = self.clock()  # needed now: the last keep to break
            self.pool.keep(hashes, now + WAITING_KEEP_S, needed_at=now)

    def pause(self, session_key: str, expected_s: float) -> None:
        hashes = self.last_blocks.get(session_key)
        self.counters["kv_pause_hints"] += 1
        if hashes is None:
            self.counters["kv_pause_unknown_sessions"] += 1
            return
        self.hinted.add(session_key)
        now = self.clock()
        if expected_s <= self.keep_s:
            until = now + expected_s * KEEP_SLACK + KEEP_MARGIN_S
            kept = self.pool.keep(hashes, until, needed_at=now + expected_s)
            self.counters["kv_pause_kept_blocks"] += kept
            return
        self._offload(hashes)
        self.counters["kv_pause_demoted_blocks"] += self.pool.demote(hashes)
        if self.connector is not None:
            heapq.heappush(self.due, (now + expected_s - PREFETCH_LEAD_S, session_key))

    def run_due(self) -> None:
        """Prefetch the runs of sessions whose long pause is about to end."""
        now = self.clock()
        while self.due and self.due[0][0] <= now:
            _, session_key = heapq.heappop(self.due)
            hashes = self.last_blocks.get(session_key)
            if hashes is None or self.connector is None:
                continue
            num_ready = self.connector.lookup(hashes)
            if num_ready < len(hashes) and self.connector.prefetch(hashes[num_ready:]):
                self.counters["kv_pause_prefetches"] += 1

    def _offload(self, hashes: Sequence[int]) -> None:
        # Write-through has put every block down as it filled; write-back writes it now.
        connector = self.connector
        if connector is None or not connector.wants_evicted:
            return
        num_there = connector.lookup(hashes)
        for block_hash in hashes[num_there:]:
            data = self.read_block(block_hash)
            if data is None:
                break
            connector.evicted(block_hash, *data)
            self.counters["kv_pause_offloaded_blocks"] += 1
