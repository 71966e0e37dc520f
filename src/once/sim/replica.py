"""One simulated replica: continuous batching with chunked prefill on a virtual clock.

Each engine step (as in vLLM V1's scheduler) first gives one token to every sequence that is
decoding, then spends the rest of the token budget on prefill chunks: running requests whose
prefill is unfinished first, then waiting requests in arrival order (FCFS) while the KV cache
can hold them (prompt plus output blocks are reserved at admission, so nothing is preempted).
The step lasts what the profile's cost model says; a request's first token comes out of the
step that finishes its prefill, the others one per decode step.

Disaggregated (`once.sim.disagg.transfer`), a prefill replica serves prefill legs: requests
of one output token whose computed KV streams to a decode replica chunk by chunk. The decode leg is
admitted there with its whole prompt but the last token in KV.

A request whose prefix continues in a tier below the device pool (`once.sim.tiers`) is
admitted, then waits off the step loop for its load: it joins prefill in the first step
that starts once its blocks are in (`ready_s`).

Speed: when a step has no prefill and nothing waiting can be admitted, the batch cannot
change until its first sequence finishes, so the replica plans that many decode steps as one
span (its length summed in closed form). An arrival during a span cuts it after the step in
progress, so the new request joins the next step exactly as it would step by step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from once.kv_eviction.base import EvictionPolicy
from once.sim.kvcache import BlockCache
from once.sim.latency import LatencyHistogram
from once.sim.profiles import ReplicaProfile
from once.sim.tiers import LowerTiers
from once.sim.workload import SimRequest


class PrefillTransfer(Protocol):
    """A prefill leg's KV on its way to a decode replica (once.sim.disagg.transfer.KVTransfer)."""

    from_tokens: int
    pull_prefix: bool

    def send(self, num_computed: int, now: float) -> None: ...

    def pull_s(self, num_tokens: int) -> float: ...


@dataclass(slots=True)
class RequestState:
    request: SimRequest
    arrival_s: float
    replica: int
    num_blocks: int = 0
    num_cached_tokens: int = 0  # not recomputed: device hits and tier loads
    num_device_cached_tokens: int = 0
    num_computed: int = 0  # prompt tokens in KV (cached + prefilled)
    ready_s: float = 0.0  # when its tier loads are in; it joins prefill from then on
    num_generated: int = 0
    held: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: bool = False
    # Prefill/decode disaggregation (`once.sim.disagg.transfer`): a prefill leg streams its KV
    # through `transfer`; the decode leg it hands off to arrives `transferred`, its prompt in KV.
    transfer: PrefillTransfer | None = None
    transferred: bool = False
    num_transferred_tokens: int = 0


@dataclass(slots=True)
class StepPlan:
    start_s: float
    num_steps: int
    decodes: list[RequestState]
    prefills: list[tuple[RequestState, int]]
    first_step_s: float  # duration of the first step
    growth_s: float  # each later step lasts this much longer (decode contexts grow)

    def duration_s(self, num_steps: int) -> float:
        return num_steps * self.first_step_s + self.growth_s * num_steps * (num_steps - 1) / 2

    def num_steps_done(self, elapsed_s: float) -> int:
        """Steps of this plan finished `elapsed_s` after its start (binary search on the
        increasing `duration_s`): the largest m <= num_steps with duration_s(m) <= elapsed."""
        lo, hi = 0, self.num_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.duration_s(mid) <= elapsed_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


class SimReplica:
    def __init__(
        self,
        index: int,
        profile: ReplicaProfile,
        kv_blocks: int | None = None,
        *,
        span_decodes: bool = True,  # False: one event per step (the reference, for tests)
        eviction: EvictionPolicy | None = None,  # None: LRU
        tiers: LowerTiers | None = None,  # below the device pool; None: evicted is gone
    ):
        self.index = index
        self.span_decodes = span_decodes
        self.name = f"replica-{index}"
        self.profile = profile
        self.tiers = tiers
        below = tiers.top if tiers is not None else None
        self.cache = BlockCache(kv_blocks or profile.kv_blocks, eviction, below)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.plan: StepPlan | None = None
        self.version = 0  # bumped whenever the pending step-end event changes
        self.busy_s = 0.0
        self.num_prefilled_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_device_cached_tokens = 0
        self.itl = LatencyHistogram()  # each decode step, once per sequence in it
        self.wakeups: list[float] = []  # when admitted requests' prefix fetches are in

    # -- what the router sees ---------------------------------------------------------------

    def num_queued_prefill_tokens(self) -> int:
        # Waiting requests count whole: their cache match is only known at admission (the
        # live router cannot know it either).
        queued = sum(s.request.num_prompt_tokens for s in self.waiting)
        return queued + sum(s.request.num_prompt_tokens - s.num_computed for s in self.running)

    def num_decode_tokens(self, now: float) -> int:
        states = [*self.waiting, *self.running]
        remaining = sum(s.request.num_output_tokens - s.num_generated for s in states)
        # Inside a span, steps already done count as decoded, as they would step by step.
        plan = self.plan
        if plan is not None and plan.num_steps > 1:
            remaining -= len(plan.decodes) * plan.num_steps_done(now - plan.start_s)
        return remaining

    # -- life cycle -------------------------------------------------------------------------

    def fits(self, request: SimRequest) -> bool:
        return self.blocks_needed(request) <= self.cache.capacity

    def blocks_needed(self, request: SimRequest) -> int:
        total_tokens = request.num_prompt_tokens + request.num_output_tokens
        return max(len(request.block_hashes), -(-total_tokens // self.profile.block_size))

    def enqueue(self, state: RequestState) -> None:
        state.num_blocks = self.blocks_needed(state.request)
        self.waiting.append(state)

    def start_step(self, now: float) -> float | None:
        """Plan the next step (or span of decode steps); returns its end time, None if idle."""
        profile = self.profile
        budget = profile.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_computed == s.request.num_prompt_tokens]
        budget -= len(decodes)
        prefills: list[tuple[RequestState, int]] = []
        for state in self.running:
            remaining = state.request.num_prompt_tokens - state.num_computed
            if remaining and budget > 0 and state.ready_s <= now:
                prefills.append((state, min(remaining, budget)))
                budget -= prefills[-1][1]
        while self.waiting and budget > 0 and len(self.running) < profile.max_num_seqs:
            state = self.waiting[0]
            if not self._admit(state, now):
                break  # FCFS: the head waits for space, nothing overtakes it
            self.waiting.popleft()
            self.running.append(state)
            if state.ready_s > now:
                continue  # loading from a lower tier
            chunk = min(state.request.num_prompt_tokens - state.num_computed, budget)
            prefills.append((state, chunk))
            budget -= chunk
        if not decodes and not prefills:
            self.plan = None
            return None
        context = sum(s.request.num_prompt_tokens + s.num_generated for s in decodes)
        first_step_s = profile.step_base_s + profile.decode_s(len(decodes), context)
        first_step_s += sum(profile.prefill_s(chunk, s.num_computed) for s, chunk in prefills)
        num_steps = 1
        if not prefills and self.span_decodes:  # nothing can join until a decode finishes: one span
            num_steps = min(s.request.num_output_tokens - s.num_generated for s in decodes)
        growth_s = profile.decode_per_context_token_s * len(decodes)
        self.plan = StepPlan(now, num_steps, decodes, prefills, first_step_s, growth_s)
        self.version += 1
        return now + self.plan.duration_s(num_steps)

    def cut_span(self, now: float) -> float | None:
        """An arrival during a decode span: end the span after the step in progress.
        Returns the new end time, or None when the pending event stays valid."""
        plan = self.plan
        if plan is None or plan.num_steps == 1:
            return None
        # The step in progress at `now` finishes; a step ending exactly now is done.
        num_steps = max(1, plan.num_steps_done(now - plan.start_s))
        if plan.duration_s(num_steps) < now - plan.start_s:
            num_steps += 1
        if num_steps >= plan.num_steps:
            return None
        plan.num_steps = num_steps
        self.version += 1
        return plan.start_s + plan.duration_s(num_steps)

    def finish_step(self, now: float) -> list[RequestState]:
        """Apply the planned step(s) at their end time `now`; returns finished requests."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("finish_step() without a planned step")
        self.plan = None
        self.busy_s += now - plan.start_s
        if plan.decodes:
            self.itl.add_linear_span(
                plan.first_step_s, plan.growth_s, plan.num_steps, len(plan.decodes)
            )
        finished = []
        for state in plan.decodes:
            state.num_generated += plan.num_steps
            if state.num_generated >= state.request.num_output_tokens:
                finished.append(state)
        for state, chunk in plan.prefills:
            state.num_computed += chunk
            self.num_prefilled_tokens += chunk
            if state.transfer is not None:
                state.transfer.send(state.num_computed, now)
            if state.num_computed == state.request.num_prompt_tokens:
                self.cache.publish(state.request.block_hashes, state.held, now)
                state.num_generated = 1
                state.first_token_s = now
                if state.request.num_output_tokens <= 1:
                    finished.append(state)
        for state in finished:
            state.finish_s = now
            self.cache.release(state.held, state.num_blocks, now)
            self.running.remove(state)
        return finished

    def _admit(self, state: RequestState, now: float) -> bool:
        request = state.request
        hashes = request.block_hashes
        num_matched = self.cache.match_prefix(hashes)
        if not self.cache.can_admit(hashes, num_matched, state.num_blocks):
            return False
        # Tier blocks are read before the device evicts to make room: the evicted blocks
        # written back below must not push out the ones this request is loading.
        block_size = self.profile.block_size
        max_cached = request.num_prompt_tokens - 1  # one is always computed: the first token
        state.num_device_cached_tokens = min(num_matched * block_size, max_cached)
        state.num_cached_tokens = state.num_device_cached_tokens
        if state.transferred:
            # Its prefill leg sent what this replica lacked; the last prompt token is
            # computed here, in the step that makes the first output token.
            state.num_transferred_tokens = max(0, max_cached - state.num_cached_tokens)
        elif self.tiers is not None:
            self._load_from_tiers(self.tiers, state, num_matched, now)
        elif state.transfer is not None and state.transfer.pull_prefix:
            pulled = max(0, min(state.transfer.from_tokens, max_cached) - state.num_cached_tokens)
            if pulled:
                state.num_cached_tokens += pulled
                state.ready_s = now + state.transfer.pull_s(pulled)
                self.wakeups.append(state.ready_s)
        state.held = self.cache.admit(hashes, num_matched, state.num_blocks, now)
        state.num_computed = state.num_cached_tokens + state.num_transferred_tokens
        if state.transfer is not None:
            state.transfer.send(state.num_computed, now)  # its cached prefix goes at once
        self.num_prompt_tokens += request.num_prompt_tokens
        self.num_cached_tokens += state.num_cached_tokens
        self.num_device_cached_tokens += state.num_device_cached_tokens
        return True

    def _load_from_tiers(
        self, tiers: LowerTiers, state: RequestState, num_matched: int, now: float
    ) -> None:
        # The loaded blocks fill the request's reserved private blocks and are published
        # with its computed ones when its prefill completes.
        hashes = state.request.block_hashes
        tiers.admitted(hashes, now)
        counts = tiers.load(hashes, num_matched, now)
        if not any(counts):
            return
        max_cached = state.request.num_prompt_tokens - 1
        num_blocks = num_matched
        for store, num in zip(tiers.stores, counts, strict=True):
            num_blocks += num
            cached = min(num_blocks * self.profile.block_size, max_cached)
            store.stats.num_hit_tokens += cached - state.num_cached_tokens
            state.num_cached_tokens = cached
        state.ready_s = now + tiers.load_s(counts)
        tiers.pending.append(state.ready_s)
