"""A request's state inside the engine."""

import enum
import time
from concurrent.futures import Future

import torch

from once.engine.grammar import RequestGrammar
from once.protocol.engine import GenerateRequest, RequestMetrics


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(self, request: GenerateRequest, eos_token_ids: tuple[int, ...], max_len: int):
        self.request_id = request.request_id
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.sampling = request.sampling
        self.forced_output_ids = request.forced_output_ids
        self.cache_salt = request.cache_salt
        self.session_key = request.session_key
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)  # prompt + outputs, for hashing
        self.block_hashes: list[int] = []  # of full blocks of all_token_ids, grown lazily
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        # Speculative decoding: ids drafted for this step (never part of all_token_ids
        # until accepted) and, for a sampling drafter, the (k, vocab) probs they came from.
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_token_ids = set(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        max_tokens = request.sampling.max_tokens
        if self.forced_output_ids is not None:
            max_tokens = min(max_tokens, len(self.forced_output_ids))
        # Stop at the context limit too: the model has no positions beyond it.
        self.max_output_tokens = min(max_tokens, max_len - len(self.prompt_token_ids))
        # Structured outputs: the request's grammar matcher (grammar.RequestGrammar), set
        # by the engine at admission; None when free or forced (forced ids bypass it).
        self.grammar: RequestGrammar | None = None  # a constraint's matcher (grammar.py)
        self.generator: torch.Generator | None = None
        if request.sampling.seed is not None and not request.sampling.greedy:
            self.generator = torch.Generator().manual_seed(request.sampling.seed)

        self.metrics = RequestMetrics(num_prompt_tokens=len(self.prompt_token_ids))
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.prefix_hit_counted = False  # the first prefix match sets num_cached_tokens
        # Prompt positions whose K/V this request has had (from the cache or computed) at
        # any admission: past a preemption, what is below it and runs again is recomputed.
        self.num_prompt_obtained = 0
        self.num_tier_loaded_tokens = 0  # loaded by the connector for its next admission
        # Blocks of its prefix being brought up from a slower KV tier (at most once).
        self.kv_prefetch: Future | None = None
        self.kv_prefetch_started = 0.0
        self.kv_prefetch_settled = False
        # Disaggregated decode: the prompt's partial last block may come from the prefill
        # engine too (kv/disagg/role.py), so only its last token is computed here.
        self.kv_remote_tail = False
        # (address, request id) of the prefill engine holding its blocks until released.
        self.kv_transfer_source: tuple[str, str] | None = None
        # A prefill engine's request that a decode side will read (`do_remote_decode`).
        self.kv_hold_for_decode = False
        self.kv_prompt_tail_hash: int | None = None  # its prompt tail, once in the store
        self.num_emitted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_decoding(self) -> bool:
        """All committed tokens but the last have K/V: the next step is a decode."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def num_draft_slots(self) -> int:
        """Most drafts one verification may carry: the bonus token must still fit."""
        return self.max_output_tokens - len(self.output_token_ids) - 1

    def clear_draft(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        # The one place output ids are committed, so the matcher consumes each exactly
        # once (a recompute after preemption re-runs ids without committing them again).
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def check_stop(self) -> str | None:
        last = self.output_token_ids[-1]
        if self.forced_output_ids is not None:
            if len(self.output_token_ids) >= self.max_output_tokens:
                return "stop" if last in self.stop_token_ids else "length"
            return None
        if last in self.stop_token_ids:
            return "stop"
        if self.grammar is not None and self.grammar.is_complete:
            return "stop"  # the grammar admits nothing more: only eos could follow
        if len(self.output_token_ids) >= self.max_output_tokens:
            return "length"
        return None

    def next_forced_token(self) -> int | None:
        if self.forced_output_ids is None:
            return None
        return self.forced_output_ids[len(self.output_token_ids)]

    def finalize_metrics(self) -> RequestMetrics:
        m = self.metrics
        now = time.perf_counter()
        m.num_output_tokens = len(self.output_token_ids)
        m.e2e_s = now - self.arrival_time
        if self.first_scheduled_time is not None:
            m.queue_s = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            m.ttft_s = self.first_token_time - self.arrival_time
            if m.num_output_tokens > 1 and self.last_token_time is not None:
                m.mean_token_latency_s = (self.last_token_time - self.first_token_time) / (
                    m.num_output_tokens - 1
                )
        return m
