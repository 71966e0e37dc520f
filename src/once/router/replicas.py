"""One replica as the router sees it: a client, its load, its speed, its cache, its health.

The router never asks a replica for its load before routing (that is a round trip per
request): it counts what it sent. Per request in flight it keeps the prompt tokens still
to prefill, the output tokens still expected, and the KV blocks held; `view()` sums them
into the `ReplicaView` the policies read. The tokens still to prefill are an estimate:
the replica is taken to work through the prefills in flight first come, first served (as
the engine's chunked prefill does) at its estimated speed, so a request sent 0.3 s ago to
a replica doing 10k tokens/s counts 3k tokens fewer. A request that drains to nothing
without its first token counts half its prefill until that token comes, and holds the
queue behind it (the estimate was wrong for it; by how much is unknown). Counting each
request whole until its first token instead would overstate a busy replica's queue by the
work it has done already, steer work to a slower replica that the busy one would have
finished sooner, and feed the speed fit queues that were partly done (so it would overrate
every replica).

Speed is measured from the requests themselves, in the unit the once policy predicts in:
- prefill: the TTFT the router observed against the work it predicted (prompt tokens
  queued ahead at dispatch + this request's uncached tokens), fitted as
  ttft = overhead + work / speed by weighted least squares over the last 64 requests
  (recent ones weigh more): a plain work/ttft mean would call a replica that serves
  mostly cache hits slow, since its short prefills are all overhead. It folds in
  queueing, network and the decode steps sharing the engine, so the prediction is
  calibrated to itself. The overhead is held within [0, the smallest TTFT of the window]
  (no request is faster than the overhead): a free intercept takes up the TTFT that an
  underrated queue leaves unexplained, which raises the speed, which underrates the queue
  further.
- decode: output tokens / time after the first token, per stream, times the streams in
  flight (aggregate throughput of the batch).
Both start from the same prior on every replica, so an unmeasured replica is neither
favoured nor shunned. DESIGN.md ("Tuning record") has the live runs behind these choices.

Health: `mark_down` after a failure (death, timeout); the router's health loop calls
`probe()` (the client's `check_health()` when it has one, else `stats()`) and a success
brings the replica back. Its prefix index is cleared on the way down (a
restarted engine has an empty cache and sends no event saying so).
"""

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from once.protocol.engine import EngineClient, GenerateRequest, RequestMetrics
from once.router.index import ApproximatePrefixIndex, ExactPrefixIndex
from once.router.policies import ReplicaView

DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
DEFAULT_DECODE_TOKENS_PER_S = 20.0
DEFAULT_OUTPUT_TOKENS = 256  # the expected output until finished requests say otherwise
SPEED_SMOOTHING = 0.2  # weight of a new sample in the moving averages
OVERDUE_SHARE_LEFT = 0.5  # of its prefill, left to a request past its predicted first token


@dataclass(frozen=True)
class ServerLoad:
    """What a replica's server reports of its own load (vLLM: /metrics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of its KV pool in use


@runtime_checkable
class ReportsServerLoad(Protocol):
    async def server_load(self) -> ServerLoad: ...


class ReplicaFailure(Exception):
    """Internal to the router: the replica, not the request, failed."""


def moving_average(old: float, sample: float, weight: float = SPEED_SMOOTHING) -> float:
    return (1 - weight) * old + weight * sample


class PrefillSpeedMeter:
    """Weighted least squares of ttft = overhead + work / speed, overhead in [0, min ttft]."""

    def __init__(self, prior_tokens_per_s: float, decay: float = 0.95, window: int = 64):
        self.tokens_per_s = prior_tokens_per_s
        self.decay = decay
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (work, ttft)
        self.overhead_s = 0.0

    def add(self, work_tokens: float, ttft_s: float) -> None:
        self.samples.append((float(work_tokens), float(ttft_s)))
        sw = sx = sy = sxx = sxy = 0.0
        weight = 1.0  # the newest sample's; each older one decays by `decay`
        for x, y in reversed(self.samples):
            sw += weight
            sx += weight * x
            sy += weight * y
            sxx += weight * x * x
            sxy += weight * x * y
            weight *= self.decay
        if sxx <= 0:
            return  # no work measured yet (every sample 0 tokens)
        spread = sxx - sx * sx / sw
        slope = (sxy - sx * sy / sw) / spread if spread > 1e-9 * sxx else 0.0
        overhead = (sy - slope * sx) / sw
        # The overhead is at most the fastest first token, and at most half of the first
        # token of the request with the most work: that one is mostly prefill. A fit past
        # that has read batching as overhead (a server that prefills concurrent prompts
        # together gives prompts of different lengths the same first-token time) and
        # would rate the replica's prefill as nearly free.
        _, largest_ttft = max(self.samples)
        floor = min(min(y for _, y in self.samples), 0.5 * largest_ttft)
        if slope <= 0 or not 0.0 <= overhead <= floor:
            # Refit the slope alone with the overhead clamped into its range.
            overhead = min(max(overhead if slope > 0 else 0.0, 0.0), floor)
            slope = (sxy - overhead * sx) / sxx
        if slope > 0:
            self.tokens_per_s = 1.0 / slope
            self.overhead_s = overhead


@dataclass
class InFlight:
    num_prefill_tokens: int  # this request's uncached prompt tokens, as predicted at dispatch
    num_queued_ahead: int  # prefill tokens estimated ahead of it on the replica when sent
    num_prefill_left: float  # the estimate still to prefill: drained FCFS, 0 at the first delta
    num_decode_tokens: int  # expected output still to come
    num_blocks: int
    num_prompt_tokens: int
    num_predicted_cached_tokens: int  # what the prefix index promised at dispatch
    sent_at: float
    first_delta_at: float | None = None
    num_output_tokens: int = 0
    # False for a decode leg whose prompt KV comes from a prefill replica: its first token
    # waits for a transfer, not for prefill, so it says nothing of the replica's speed.
    learns_speed: bool = True
    overdue: bool = False  # drained to nothing without a first token (see Replica.drain)


# What a policy charges to bring one block up from a KV tier (exact index only): a host
# copy of a SmolLM2 fp32 block (737 KB) at a few GB/s; disk and Redis cost more, but still
# a fraction of recomputing a block (~16 tokens of prefill).
TIER_LOAD_S_PER_BLOCK = 2e-4


class Replica:
    def __init__(
        self,
        name: str,
        client: EngineClient,
        *,
        index: int,
        block_size: int = 16,
        kv_blocks_total: int = 2000,
        prefix_index: ApproximatePrefixIndex | ExactPrefixIndex | None = None,
        kv_event_source=None,
        index_feed: Callable[[ExactPrefixIndex], Coroutine[Any, Any, None]] | None = None,
        prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        decode_tokens_per_s: float = DEFAULT_DECODE_TOKENS_PER_S,
        live_estimates: bool = True,
        tier_load_s_per_block: float = TIER_LOAD_S_PER_BLOCK,
        role: str = "both",  # "prefill": only prefill legs of split requests (disagg/routing.py)
    ):
        if block_size < 1 or kv_blocks_total < 1:
            raise ValueError("block_size and kv_blocks_total must be >= 1")
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {role!r}")
        self.role = role
        self.name = name
        self.client = client
        self.index = index
        self.block_size = block_size
        self.kv_blocks_total = kv_blocks_total
        self.tier_load_s_per_block = tier_load_s_per_block
        # `is None`, not `or`: an empty exact index is falsy (it has a length).
        if prefix_index is None:
            prefix_index = ApproximatePrefixIndex(kv_blocks_total)
        self.prefix_index = prefix_index
        # A callable returning new KV events (e.g. LLMEngine.take_kv_events) for an exact
        # index fed in process; remote sources push into the index themselves.
        self.kv_event_source = kv_event_source
        # A coroutine that keeps an exact index current until cancelled (a ZMQ subscriber
        # to the replica's KV events, router/index.py); the router runs it in the
        # background from start() until aclose().
        self.index_feed = index_feed
        self._feed_task: asyncio.Task | None = None
        self.prefill_meter = PrefillSpeedMeter(prefill_tokens_per_s)
        self.decode_tokens_per_s_per_stream = decode_tokens_per_s
        self.mean_output_tokens = float(DEFAULT_OUTPUT_TOKENS)
        self.healthy = True
        self.down_reason: str | None = None
        self.down_since: float | None = None
        self.in_flight: dict[str, InFlight] = {}  # in dispatch order
        # From the server's own report (refresh_server_load): requests it runs or queues
        # that this router did not send (other routers, direct clients), and its KV use.
        self.num_external_requests = 0
        self.server_kv_blocks_used = 0
        # False freezes the queue and speed estimates between first tokens (the
        # simulator's parity check routes a wave that arrives at one instant).
        self.live_estimates = live_estimates
        self._drained_at = time.monotonic()
        self.counters = dict.fromkeys(
            (
                "num_routed",
                "num_finished",
                "num_failures",
                "num_rejoins",
                "num_prompt_tokens",
                "num_cached_tokens",
                "num_predicted_cached_tokens",
            ),
            0,
        )

    # -- what the policies see --------------------------------------------------------------

    def sync_index(self) -> None:
        if self.kv_event_source is not None and isinstance(self.prefix_index, ExactPrefixIndex):
            self.prefix_index.apply(self.kv_event_source())

    def start_index_feed(self) -> None:
        if self.index_feed is None or not isinstance(self.prefix_index, ExactPrefixIndex):
            return
        if self._feed_task is None or self._feed_task.done():
            self._feed_task = asyncio.get_running_loop().create_task(
                self.index_feed(self.prefix_index)
            )

    async def stop_index_feed(self) -> None:
        task, self._feed_task = self._feed_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def num_cached_blocks(self, block_hashes: tuple[int, ...], num_prompt_tokens: int) -> int:
        # An engine always computes the last prompt token (its logits give the first output
        # token), so a prompt that is all full blocks can reuse one block fewer.
        usable = block_hashes[: max(0, num_prompt_tokens - 1) // self.block_size]
        return self.prefix_index.match(usable)

    def prefill_tokens_per_s(self, now: float) -> float:
        """The fitted speed, capped by what the requests still waiting for their first
        token show: one sent `waited` seconds ago with `work` tokens ahead of it and its
        own still has none, so the replica does fewer than work / (waited - overhead)
        tokens a second. The fit learns only from first tokens, rarely on a replica the
        policy avoids; this catches a slowdown (or a stall) while it happens."""
        speed = self.prefill_meter.tokens_per_s
        if not self.live_estimates:
            return speed
        overhead = self.prefill_meter.overhead_s
        for flight in self.in_flight.values():
            waited = now - flight.sent_at - overhead
            if flight.first_delta_at is None and waited > 0 and flight.learns_speed:
                speed = min(speed, (flight.num_queued_ahead + flight.num_prefill_tokens) / waited)
        return speed

    def drain(self, now: float, speed: float | None = None) -> None:
        """Take the prefill work the replica did since the last call off the flights'
        estimates, oldest first, at its estimated speed (none of it while idle); `speed`
        is `prefill_tokens_per_s(now)` when the caller has it already."""
        if now <= self._drained_at:
            return
        if speed is None:
            speed = self.prefill_tokens_per_s(now)
        budget = (now - self._drained_at) * speed
        self._drained_at = now
        if not self.live_estimates:
            return
        for flight in self.in_flight.values():
            if budget <= 0 or flight.overdue:
                break
            done = min(flight.num_prefill_left, budget)
            flight.num_prefill_left -= done
            budget -= done
            late = flight.num_prefill_left <= 0 and flight.first_delta_at is None
            if late and flight.learns_speed:
                # Drained, and still no first token: the speed estimate ran fast for it,
                # and how far its prefill got cannot be seen from here. Counted half done
                # until its first token, it holds the queue behind it; read as done, it
                # would draw new work onto a replica still busy with it.
                flight.overdue = True
                flight.num_prefill_left = OVERDUE_SHARE_LEFT * flight.num_prefill_tokens
                break

    def num_queued_prefill_tokens(
        self, now: float | None = None, speed: float | None = None
    ) -> int:
        self.drain(time.monotonic() if now is None else now, speed)
        return round(sum(f.num_prefill_left for f in self.in_flight.values()))

    def view(self, block_hashes: tuple[int, ...], num_prompt_tokens: int) -> ReplicaView:
        flights = self.in_flight.values()
        now = time.monotonic()
        speed = self.prefill_tokens_per_s(now)
        cached = self.num_cached_blocks(block_hashes, num_prompt_tokens)
        tier_blocks: tuple[int, ...] = ()
        if isinstance(self.prefix_index, ExactPrefixIndex):
            usable = block_hashes[: max(0, num_prompt_tokens - 1) // self.block_size]
            num_in_tiers = self.prefix_index.match_tiers(usable, cached)
            tier_blocks = (num_in_tiers,) if num_in_tiers else ()
        return ReplicaView(
            index=self.index,
            name=self.name,
            healthy=self.healthy,
            num_running=len(self.in_flight) + self.num_external_requests,
            num_queued_prefill_tokens=self.num_queued_prefill_tokens(now, speed),
            num_decode_tokens=sum(f.num_decode_tokens for f in flights),
            kv_blocks_used=max(sum(f.num_blocks for f in flights), self.server_kv_blocks_used),
            kv_blocks_total=self.kv_blocks_total,
            cached_prefix_blocks=cached,
            tier_prefix_blocks=tier_blocks,
            tier_load_s=sum(tier_blocks) * self.tier_load_s_per_block,
            prefill_tokens_per_s=speed,
            decode_tokens_per_s=self.decode_tokens_per_s_per_stream * max(1, len(flights)),
        )

    # -- request life cycle (called by the router) ------------------------------------------

    def on_dispatch(self, request: GenerateRequest, block_hashes: tuple[int, ...]) -> None:
        num_prompt = len(request.prompt_token_ids)
        cached = self.num_cached_blocks(block_hashes, num_prompt) * self.block_size
        transferred = bool((request.kv_transfer_params or {}).get("do_remote_prefill"))
        if transferred:
            cached = num_prompt - 1  # only the last prompt token is computed here
        expected_output = request.sampling.max_tokens
        if request.forced_output_ids is not None:
            expected_output = len(request.forced_output_ids)
        else:
            expected_output = min(expected_output, round(self.mean_output_tokens))
        num_prefill = max(1, num_prompt - cached)
        self.in_flight[request.request_id] = InFlight(
            num_prefill_tokens=num_prefill,
            num_queued_ahead=self.num_queued_prefill_tokens(),
            num_prefill_left=num_prefill,
            num_decode_tokens=expected_output,
            num_blocks=-(-(num_prompt + expected_output) // self.block_size),
            num_prompt_tokens=num_prompt,
            num_predicted_cached_tokens=cached,
            sent_at=time.monotonic(),
            learns_speed=not transferred,
        )
        self.counters["num_routed"] += 1
        if isinstance(self.prefix_index, ApproximatePrefixIndex):
            self.prefix_index.record(block_hashes)

    def on_delta(self, request_id: str, num_new_tokens: int) -> None:
        flight = self.in_flight.get(request_id)
        if flight is None:
            return
        now = time.monotonic()
        if flight.first_delta_at is None:
            flight.first_delta_at = now
            self.drain(now)
            flight.num_prefill_left = 0
            flight.overdue = False
            if flight.learns_speed:
                work = flight.num_queued_ahead + flight.num_prefill_tokens
                self.prefill_meter.add(work, now - flight.sent_at)
        flight.num_output_tokens += num_new_tokens
        flight.num_decode_tokens = max(0, flight.num_decode_tokens - num_new_tokens)

    def on_finish(
        self,
        request_id: str,
        metrics: RequestMetrics | None,
        num_cached_tokens: int | None,
        completed_hashes: list[int] | None = None,
    ) -> None:
        flight = self.in_flight.pop(request_id, None)
        if flight is None:
            return
        # Prompt and cached tokens of finished requests only, so the hit rate is exact.
        self.counters["num_finished"] += 1
        self.counters["num_prompt_tokens"] += flight.num_prompt_tokens
        self.counters["num_cached_tokens"] += num_cached_tokens or 0
        self.counters["num_predicted_cached_tokens"] += flight.num_predicted_cached_tokens
        num_output = flight.num_output_tokens
        self.mean_output_tokens = moving_average(self.mean_output_tokens, num_output)
        if flight.first_delta_at is not None and num_output > 1:
            decode_s = time.monotonic() - flight.first_delta_at
            if decode_s > 1e-4:
                rate = (num_output - 1) / decode_s
                self.decode_tokens_per_s_per_stream = moving_average(
                    self.decode_tokens_per_s_per_stream, rate
                )
        if completed_hashes and isinstance(self.prefix_index, ApproximatePrefixIndex):
            self.prefix_index.record(completed_hashes)

    def on_abandon(self, request_id: str) -> None:
        """The request failed or was cut off: forget it without learning from it."""
        self.in_flight.pop(request_id, None)

    # -- health -----------------------------------------------------------------------------

    def mark_down(self, reason: str) -> None:
        self.counters["num_failures"] += 1
        if self.healthy:
            self.healthy = False
            self.down_reason = reason
            self.down_since = time.monotonic()
        self.in_flight.clear()
        self.prefix_index.clear()

    async def probe(self, timeout_s: float = 5.0) -> bool:
        """True when the replica answers its health check (or, lacking one, `stats()`
        without reporting a dead engine loop) within `timeout_s`."""

        async def check() -> bool:
            check_health = getattr(self.client, "check_health", None)
            if check_health is not None:
                result = check_health()
                if hasattr(result, "__await__"):
                    await result
                return True
            stats = await self.client.stats()
            return bool(stats.get("engine_alive", True))

        try:
            return await asyncio.wait_for(check(), timeout_s)
        except Exception:  # any failure of the probe (timeout included) keeps it down
            return False

    async def refresh_server_load(self, timeout_s: float = 5.0) -> bool:
        """Read the server's own load when its client reports one; False when it did not
        answer (the health loop, not this, decides whether the replica is down)."""
        if not isinstance(self.client, ReportsServerLoad):
            return False
        try:
            load = await asyncio.wait_for(self.client.server_load(), timeout_s)
        except Exception:  # a slow or failed scrape keeps the last figures
            return False
        # The server counts this router's requests too: only the excess is someone else's.
        self.num_external_requests = max(
            0, load.num_running + load.num_waiting - len(self.in_flight)
        )
        self.server_kv_blocks_used = round(load.kv_cache_usage * self.kv_blocks_total)
        return True

    def mark_up(self) -> None:
        if not self.healthy:
            self.healthy = True
            self.down_reason = None
            self.down_since = None
            self.counters["num_rejoins"] += 1

    def stats(self) -> dict:
        view = self.view((), 0)
        return {
            "name": self.name,
            "role": self.role,
            "healthy": self.healthy,
            "down_reason": self.down_reason,
            "num_running": view.num_running,
            "num_queued_prefill_tokens": view.num_queued_prefill_tokens,
            "num_decode_tokens": view.num_decode_tokens,
            "kv_blocks_used": view.kv_blocks_used,
            "num_external_requests": self.num_external_requests,
            "prefill_tokens_per_s": round(self.prefill_meter.tokens_per_s, 1),
            "decode_tokens_per_s_per_stream": round(self.decode_tokens_per_s_per_stream, 2),
            "prefix_index": self.prefix_index.kind,
            "prefix_index_blocks": len(self.prefix_index),
            **self.counters,
        }


def in_process_replica(name: str, async_engine, *, index: int, role: str = "both") -> Replica:
    """A replica around an in-process `AsyncEngine`, with an exact prefix index fed by its
    `LLMEngine.take_kv_events()` (drained before each routing decision). The engine hashes
    blocks like the router, so its hashes are used as they are."""
    core = async_engine.engine
    core.enable_kv_events()
    return Replica(
        name,
        async_engine,
        index=index,
        block_size=core.config.block_size,
        kv_blocks_total=len(core.pool.blocks),
        prefix_index=ExactPrefixIndex(rehash=False),
        kv_event_source=core.take_kv_events,
        role=role,
    )
