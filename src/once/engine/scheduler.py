"""Continuous batching with chunked prefill under a per-step token budget.

Each step:
  1. Running requests first, in arrival order: a decode takes 1 token of the budget
     (1 + k with k drafted tokens to verify; drafts are trimmed to the budget and
     dropped before anyone is preempted for them), a partial prefill takes the next
     chunk. If the cache cannot hold a request's new tokens, the newest running request
     is preempted (its blocks freed, to be recomputed later; cached blocks usually
     survive and turn the recompute into a prefix hit) until it fits or the request
     itself was the newest.
  2. Then waiting requests, oldest first, while budget, sequence slots and blocks remain:
     each looks up its prefix in the cache and is scheduled for the uncached rest (up to
     the budget). A request that does not fit waits its turn; nothing behind it jumps the
     queue, so a big request is never starved. The one exception: a request whose prefix
     is being brought up from a slower KV tier steps aside (`loading`) while the others
     run, and goes back to the head of the queue when its blocks are in or its wait
     (`load_timeout_s`) is over, whichever comes first; what did not arrive is recomputed.

After the forward, `update_from_output` moves every scheduled request on by what ran and
commits each sampled request's ids (see there). It changes request state only; what
happened comes back as a `StepUpdate`, from which the engine keeps its counters and
builds its deltas.
"""

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field

from once.engine.kv.manager import KVCacheManager
from once.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This step's tokens reach the end of the request's known ones (its drafts
        included), so its last rows get logits. Read before `update_from_output`."""
        request = self.request
        end = request.num_computed_tokens + self.num_new_tokens
        return end == request.num_tokens + len(request.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[Request]


@dataclass
class RequestUpdate:
    """The ids one sampled request committed in a step."""

    request: Request
    new_token_ids: list[int]
    finish_reason: str | None  # set when one of them stopped it (the request is finished)


@dataclass
class StepUpdate:
    """What a step did to its requests, for the engine's deltas and counters."""

    outputs: list[RequestUpdate] = field(default_factory=list)  # in the order they ran
    num_computed_prompt_tokens: int = 0
    num_recomputed_tokens: int = 0  # prompt and output positions run again after preemption
    # Ids committed by each sampled request that was decoding (drafted or not).
    num_tokens_per_decode: list[int] = field(default_factory=list)
    verifications: list[tuple[int, int]] = field(default_factory=list)  # (drafts, accepted)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(output.new_token_ids) for output in self.outputs)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        load_timeout_s: float = 2.0,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.load_timeout_s = load_timeout_s
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # waiting for a KV tier's prefetch, in order
        self.num_preemptions = 0
        self.num_load_timeouts = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _return_loaded(self) -> None:
        now = time.monotonic()
        back = []
        for request in self.loading:
            future = request.kv_prefetch
            assert future is not None  # only a started prefetch parks a request
            if future.done() or now - request.kv_prefetch_started >= self.load_timeout_s:
                if not future.done():
                    self.num_load_timeouts += 1
                request.kv_prefetch_settled = True
                back.append(request)
        if back:
            self.loading = [r for r in self.loading if not r.kv_prefetch_settled]
            self.waiting.extendleft(reversed(back))

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a parked request's prefetch is done (or `timeout_s`): what a step
        with nothing else to run does instead of spinning."""
        futures = [r.kv_prefetch for r in self.loading if r.kv_prefetch is not None]
        if futures:
            wait_for_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_running_tokens(request, budget)
            while not self.kv.allocate(request, num_new):
                if request.draft_token_ids:
                    # Drafts never cost another request its blocks: verify nothing instead.
                    request.clear_draft()
                    num_new = self._num_running_tokens(request, budget)
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
                continue
            # The request preempted itself: it was the last one running.
            break

        if self.loading:
            self._return_loaded()
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            external_before = self.kv.num_external_hit_tokens
            hit_blocks, num_hit_tokens = self.kv.match_prefix(request, budget)
            request.num_tier_loaded_tokens += self.kv.num_external_hit_tokens - external_before
            if request.kv_prefetch is not None and not request.kv_prefetch_settled:
                self.waiting.popleft()
                self.loading.append(request)
                continue
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate(request, num_new, hit_blocks):
                break
            if request.kv_remote_tail and not request.output_token_ids and num_new > 1:
                num_tail = self.kv.load_tail(request, num_hit_tokens)
                num_hit_tokens, num_new = num_hit_tokens + num_tail, num_new - num_tail
                request.num_tier_loaded_tokens += num_tail
            self.waiting.popleft()
            if not request.prefix_hit_counted:
                # The first admission is the lookup that counts for the hit rate; a
                # recompute after preemption is the engine's own doing.
                request.prefix_hit_counted = True
                self.kv.record_lookup(request.num_prompt_tokens, num_hit_tokens)
            self._count_hit(request, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

    @staticmethod
    def _count_hit(request: Request, num_hit_tokens: int) -> None:
        # Cached are the prompt positions a hit brings that the request never had: after
        # a preemption, a hit on its own earlier work is not a cache saving, and what it
        # computes again below `num_prompt_obtained` is recomputed. So, once the prompt
        # is in, prompt = cached + computed - recomputed, whatever the preemptions.
        #
        #   prompt    [..... hit h .....|.... computed ....]
        #   obtained  [.... o ....]                           (earlier admissions)
        #   cached        += max(0, h - o), of which the last loaded ones came from a tier
        num_prompt_hit = min(num_hit_tokens, request.num_prompt_tokens)
        num_loaded, request.num_tier_loaded_tokens = request.num_tier_loaded_tokens, 0
        num_fresh = max(0, num_prompt_hit - request.num_prompt_obtained)
        if num_fresh:
            request.metrics.num_cached_tokens += num_fresh
            tier_start = max(request.num_prompt_obtained, num_hit_tokens - num_loaded)
            request.metrics.num_tier_cached_tokens += max(0, num_prompt_hit - tier_start)
            request.num_prompt_obtained = num_prompt_hit

    @staticmethod
    def _num_running_tokens(request: Request, budget: int) -> int:
        # A decode with drafts verifies 1 + k tokens; a tight budget trims the drafts.
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if request.draft_token_ids:
            num_drafts = min(len(request.draft_token_ids), budget - num_new)
            if num_drafts < len(request.draft_token_ids):
                request.draft_token_ids = request.draft_token_ids[:num_drafts]
                if request.draft_probs is not None:
                    request.draft_probs = request.draft_probs[:num_drafts]
            num_new += num_drafts
        return num_new

    def _preempt(self, request: Request) -> None:
        request.clear_draft()
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        # Its blocks may have gone down a tier since its last admission: it may wait for
        # a prefetch once more.
        request.kv_prefetch, request.kv_prefetch_settled = None, False
        self.waiting.appendleft(request)

    # -- after the forward ----------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: list[Request], committed: list[list[int]]
    ) -> StepUpdate:
        """Apply a forward's results: `sampled` are the requests that got logits, in the
        runner's order, and `committed[i]` the ids sampled[i] commits (one sampled id, or a
        verification's accepted drafts plus one)."""
        # 1. Every scheduled request has the K/V of its new tokens now; the prompt tokens
        #    among them count as computed, output positions among them as recomputed.
        # 2. Each sampled request appends its ids up to the first that stops it. A
        #    verification's K/V is valid up to its last accepted draft: the newest id (the
        #    bonus or corrected token) is computed next step, and blocks past it go back.
        # 3. A stopped request is finished here, in turn, so blocks return to the pool in
        #    the same order whatever the engine does with the update.
        update = StepUpdate()
        for item in out.scheduled:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            prompt_end = min(end, request.num_prompt_tokens)
            num_prompt_part = max(0, prompt_end - start)
            num_prompt_again = max(0, min(prompt_end, request.num_prompt_obtained) - start)
            request.num_prompt_obtained = max(request.num_prompt_obtained, prompt_end)
            request.metrics.num_computed_tokens += num_prompt_part
            request.metrics.num_recomputed_tokens += num_prompt_again
            update.num_computed_prompt_tokens += num_prompt_part
            update.num_recomputed_tokens += num_prompt_again
            if start < request.num_tokens - 1 and end > request.num_prompt_tokens:
                update.num_recomputed_tokens += end - max(start, request.num_prompt_tokens)
            request.num_computed_tokens = end

        for request, token_ids in zip(sampled, committed, strict=True):
            was_decoding = bool(request.output_token_ids)
            new_token_ids, reason = [], None
            for token in token_ids:
                request.append_output(token)
                new_token_ids.append(token)
                reason = request.check_stop()
                if reason is not None:
                    break
            if was_decoding:
                update.num_tokens_per_decode.append(len(new_token_ids))
            if request.draft_token_ids:
                num_accepted = len(token_ids) - 1
                update.verifications.append((len(request.draft_token_ids), num_accepted))
                self._settle_verification(request, num_accepted)
            if reason is not None:
                self.finish(request, reason)
            update.outputs.append(RequestUpdate(request, new_token_ids, reason))
        return update

    def _settle_verification(self, request: Request, num_accepted: int) -> None:
        request.num_computed_tokens = request.num_tokens - 1
        request.metrics.num_drafts += 1
        request.metrics.num_draft_tokens += len(request.draft_token_ids)
        request.metrics.num_accepted_tokens += num_accepted
        request.clear_draft()
        self.kv.trim(request)

    def finish(self, request: Request, reason: str) -> None:
        """Finish a stopped, aborted or failed request: out of the queues, its blocks freed."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.loading:
            self.loading.remove(request)
        self.kv.free(request)
        request.clear_draft()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
