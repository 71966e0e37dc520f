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
     queue, so a big request is never starved.
"""

import time
from collections import deque
from dataclasses import dataclass

from once.engine.kv.manager import KVCacheManager
from once.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[Request]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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

        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv.match_prefix(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate(request, num_new, hit_blocks):
                break
            self.waiting.popleft()
            if not request.prefix_hit_counted:
                # The first admission is the lookup that counts; a recompute after
                # preemption is the engine's own doing, not a property of the prompt.
                request.prefix_hit_counted = True
                request.metrics.num_cached_tokens = num_hit_tokens
                self.kv.record_lookup(request.num_prompt_tokens, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

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
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Drop a finished or aborted request from the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
