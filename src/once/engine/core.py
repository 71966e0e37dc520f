"""LLMEngine: the synchronous step loop (schedule -> execute -> sample -> update -> deltas).

The scheduler owns request state: it picks the step's work and, after the forward, moves
the requests on (`Scheduler.update_from_output`). The engine owns what is counted across
requests (its `counters`, `SpecDecodeStats`, the draft-length governor), the drafter, and
the deltas it returns. KV outside the device pool (tiers, a prefill or decode role) is the
connector's, which the engine meets at its lifecycle calls (kv/connector.py). Everything
above it is asyncio; `AsyncEngine` (async_engine.py) runs this loop on a thread.
"""

import logging
import time
from dataclasses import dataclass

import torch

from once.cpus import usable_cores
from once.engine.attention import PagedKVCache
from once.engine.config import (
    EngineConfig,
    EngineSettingError,
    kv_cache_blocks,
    kv_cache_too_small,
)
from once.engine.grammar import GrammarCompiler, TokenizerFactory, tokenizer_from_model
from once.engine.kv.block_io import BlockIO
from once.engine.kv.blocks import BlockPool
from once.engine.kv.connector import KVConnector, NoOpConnector
from once.engine.kv.manager import KVCacheManager
from once.engine.kv.session_pauses import SessionPauses
from once.engine.logprobs import token_logprobs
from once.engine.masks import GrammarMasks
from once.engine.memory import keep_freed_memory
from once.engine.models.config import serving_model_config
from once.engine.models.llama import LlamaModel
from once.engine.request import Request
from once.engine.runner import ModelRunner
from once.engine.sampler import sample
from once.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
from once.engine.speculative import SpecDecodeStats, make_drafter
from once.engine.speculative.governor import DraftLengthGovernor
from once.engine.speculative.verify import accept_matching, rejection_sample, sampling_probs
from once.engine.weight_formats import weight_format
from once.kv_eviction.policies import eviction_factory
from once.protocol.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    GenerateRequest,
    TokenDelta,
    TokenLogprob,
)
from once.protocol.errors import (
    ContextLengthExceededError,
    EngineOverloadedError,
    InvalidRequestError,
    OnceError,
)

logger = logging.getLogger(__name__)


@dataclass
class Sampled:
    """What a step's forward produced, for the update."""

    requests: list[Request]  # the sampled requests, less any whose grammar failed
    committed: list[list[int]]  # the ids each of them commits
    logprobs: dict[str, list[TokenLogprob]]
    any_failed: bool  # some grammar failed: those requests have last deltas pending


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        grammar_tokenizer: TokenizerFactory | None = None,
    ):
        from once.engine.loader import load_model_weights, resolve_model_path

        # 0: the cores this process may really use (affinity, cgroup quota; cpus.py).
        torch.set_num_threads(config.num_threads or usable_cores())
        if config.device == "cpu":
            keep_freed_memory()
        self.config = config
        self.model_path = resolve_model_path(config.model)
        dtype = getattr(torch, config.dtype)
        model_config, weights, _ = load_model_weights(self.model_path, dtype, config.device)
        model_config = serving_model_config(model_config, config.rope_scaling, config.max_model_len)
        self.model_config = model_config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if model_config.sliding_window and self.max_model_len > model_config.sliding_window:
            # Sliding-window attention is not implemented: within the window it is exact.
            self.max_model_len = model_config.sliding_window
        self.model = LlamaModel(
            model_config,
            weights,
            self.max_model_len,
            weight_format(config.weights, pack=config.cpu_gemm == "onednn"),
        )
        # The model holds its own copies: the loaded tensors (SmolLM2: 0.5 GB) go before the
        # KV pool is allocated, or the start peaks at both.
        del weights

        block_size = config.block_size
        bytes_per_block = PagedKVCache.bytes_per_block(
            model_config.num_layers,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
        )
        num_blocks = kv_cache_blocks(config, bytes_per_block)
        if num_blocks * block_size < self.max_model_len:
            # One request must fit the cache (vLLM refuses to start otherwise). A context
            # asked for is refused; the model's own is cut to what the cache holds, so a
            # request the gateway admits can always run.
            if config.max_model_len:
                raise EngineSettingError(kv_cache_too_small(config, num_blocks, bytes_per_block))
            logger.warning(
                "the KV cache holds %d tokens, less than the context of %d: the context is "
                "cut to %d (raise kv_cache_gib for more)",
                num_blocks * block_size,
                self.max_model_len,
                num_blocks * block_size,
            )
            self.max_model_len = num_blocks * block_size
        self.kv_cache = PagedKVCache(
            model_config.num_layers,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            config.device,
        )
        self.pool = BlockPool(
            num_blocks,
            block_size,
            config.enable_prefix_caching,
            eviction_factory(config.kv_eviction, config.seed),
        )
        if connector is None and config.has_kv_tiers:
            from once.engine.kv.tier_setup import build_connector

            block_shape = tuple(self.kv_cache.k[:, 0].shape)
            connector = build_connector(config, self.model_path, block_shape, dtype, num_blocks)
        # The KV outside the device pool: tiers, a prefill or decode role, or nothing.
        self.connector: KVConnector = connector or NoOpConnector()
        self.kv = KVCacheManager(
            self.pool, self.connector, self.connector.load_block, self.connector.load_tail
        )
        self.blocks = BlockIO(self.kv_cache, self.pool, self.kv.block_ids)
        self.connector.register_kv_cache(self.blocks)
        # Without a connector a long pause only demotes: nothing to offload to or prefetch.
        self.pauses = SessionPauses(
            self.pool, connector, self.blocks.read_block, config.kv_pause_keep_s
        )
        if self.connector.wants_evicted:
            self.pool.on_evict = self.connector.offload_evicted
        self.kv_publisher = None
        if config.kv_events_endpoint:
            from once.engine.kv.publisher import ZmqKVEventPublisher

            self.kv_publisher = ZmqKVEventPublisher(config.kv_events_endpoint)
            self.enable_kv_events()
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            load_timeout_s=config.kv_load_timeout_s,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self._pending: list[TokenDelta] = []
        self.counters = dict.fromkeys(
            [
                "num_requests_finished",
                "num_requests_aborted",
                "num_requests_rejected",  # refused: the waiting queue was full
                "num_pause_hints_ignored",  # kv_pause_hints is off
                "num_prompt_tokens",
                "num_cached_prompt_tokens",
                "num_computed_prompt_tokens",
                "num_recomputed_tokens",
                "num_generated_tokens",
                "num_steps",
            ],
            0,
        )
        self.step_time_s = 0.0
        self.drafter = make_drafter(config, self.model_config)
        self.spec = SpecDecodeStats(config.num_speculative_tokens)
        self.governor = None  # cost-aware draft length (config.speculative_adaptive)
        if config.speculative_adaptive:
            self.governor = DraftLengthGovernor(config.num_speculative_tokens)
        # Structured outputs (grammar.py, masks.py): the tokenizer llguidance needs is
        # built from the model folder on the first constrained request, unless given.
        self.grammars = GrammarCompiler(
            grammar_tokenizer
            or tokenizer_from_model(
                self.model_path, model_config.vocab_size, model_config.eos_token_ids
            )
        )
        self.masks = GrammarMasks(model_config.vocab_size)

    # -- admission -----------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> None:
        """Checks that need no step-loop state, so callers can fail fast on their thread
        (a constraint is compiled here, into the thread-safe grammar cache)."""
        num_prompt = len(request.prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {num_prompt} tokens; this engine's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate",
                param="prompt_token_ids",
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                param="prompt_token_ids",
            )
        forced = request.forced_output_ids
        if forced is not None and (not forced or any(t < 0 or t >= vocab for t in forced)):
            raise InvalidRequestError(
                "forced_output_ids must be a non-empty list of ids in the vocabulary",
                param="forced_output_ids",
            )
        constraint = request.sampling.constraint
        if constraint is not None and forced is None:
            self.grammars.compile(constraint)  # cached: admission takes a copy

    def add_request(self, request: GenerateRequest) -> None:
        self.validate(request)
        request = self.connector.on_arrival(request)  # a prefill role: one token
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already running", param="request_id"
            )
        limit = self.config.max_num_waiting
        if limit and len(self.scheduler.waiting) >= limit:
            # A burst past what the KV cache and the queue hold: refused now, with a
            # retriable error, rather than queued for longer than a client waits.
            self.counters["num_requests_rejected"] += 1
            raise EngineOverloadedError(
                f"the engine has {limit} requests waiting for KV blocks; retry shortly"
            )
        state = Request(request, self.model_config.eos_token_ids, self.max_model_len)
        self.connector.on_admit(state, request.kv_transfer_params)
        constraint = request.sampling.constraint
        if constraint is not None and request.forced_output_ids is None:
            state.grammar = self.grammars.matcher(constraint)
        self.requests[request.request_id] = state
        self.pauses.arrived(request.session_key)
        self.scheduler.add(state)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return  # finished already, or never existed: nothing to do
        self._finish(request, FINISH_ABORT)
        self.counters["num_requests_aborted"] += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the step --------------------------------------------------------------------------

    def pause_session(self, session_key: str, expected_s: float) -> None:
        """The session's agent runs a tool expected to take `expected_s` (a hint)."""
        if self.config.kv_pause_hints:
            self.pauses.pause(session_key, expected_s)
        else:
            self.counters["num_pause_hints_ignored"] += 1

    def run_timers(self) -> None:
        """Work due at a time rather than at a step: prefetches before a pause ends."""
        if self.pauses.due:
            self.pauses.run_due()

    def step(self) -> list[TokenDelta]:
        deltas = self._take_pending()  # of requests aborted since the last step
        self.run_timers()
        out = self._schedule()
        if out is None:
            return deltas
        # Read before the forward runs (it moves every request on); only the governor uses it.
        decode_only = self.governor is not None and all(
            s.request.is_decoding for s in out.scheduled
        )
        started = time.perf_counter()
        sampled = self._run(out)
        if sampled is None:  # the forward failed: so did its requests
            return deltas + self._take_pending()
        deltas += self._update(out, sampled)

        elapsed = time.perf_counter() - started
        self.step_time_s += elapsed
        if decode_only and self.governor is not None:
            self.governor.observe_step(out.num_batched_tokens, elapsed)
        return deltas

    def _schedule(self) -> SchedulerOutput | None:
        """Drafts for the decoding requests, then the step's work; None when there is
        none (after a short wait when only KV prefetches are in flight)."""
        if self.drafter is not None:
            self._propose_drafts()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.loading:
                self.scheduler.wait_for_loads(0.01)  # only KV prefetches are in flight
            return None
        return out

    def _run(self, out: SchedulerOutput) -> Sampled | None:
        """The forward, the grammar masks and the tokens each sampled request commits;
        None when the forward failed (its requests are finished with the error)."""
        masks = self.masks.start(out.scheduled)  # filled on a worker during the forward
        try:
            logits, sampled = self.runner.execute(out.scheduled)
        except Exception as exc:  # a failed forward fails its requests, not the engine
            if masks is not None:
                masks.wait()  # the matchers are not touched while a fill reads them
            error = OnceError(f"forward failed: {type(exc).__name__}: {exc}")
            for item in out.scheduled:
                self._finish(item.request, FINISH_ERROR, error=error.to_dict())
            return None
        requests = [s.request for s in sampled]
        failed = [] if masks is None else masks.apply(logits, requests)
        committed = self._select_tokens(logits, requests)
        # Read after the masks (constrained rows report the masked distribution) and
        # before failed requests leave the lists (rows are counted over all of them).
        logprobs = token_logprobs(logits, requests, committed)  # {} when no row asks
        if failed:
            requests, committed = self._fail_grammars(failed, requests, committed)
        return Sampled(requests, committed, logprobs, bool(failed))

    def _update(self, out: SchedulerOutput, sampled: Sampled) -> list[TokenDelta]:
        """The connector hears of the computed blocks, the scheduler moves the requests
        on, and the update becomes deltas."""
        self.connector.after_forward(out.scheduled)  # save, hand off, release transfers
        update = self.scheduler.update_from_output(out, sampled.requests, sampled.committed)
        self._record(update)
        deltas = self._deltas(update, sampled.logprobs)
        if sampled.any_failed:
            deltas += self._take_pending()  # the failed requests' last deltas
        return deltas

    def _fail_grammars(self, failed, requests, committed):
        """Finish requests whose matcher failed (their rows were sampled unmasked, and
        those ids are dropped); the rest of the step goes on without them."""
        for request, message in failed:
            error = OnceError(f"structured output failed: {message}")
            self._finish(request, FINISH_ERROR, error=error.to_dict())
        kept = [i for i, request in enumerate(requests) if not request.is_finished]
        return [requests[i] for i in kept], [committed[i] for i in kept]

    def _record(self, update: StepUpdate) -> None:
        self.counters["num_computed_prompt_tokens"] += update.num_computed_prompt_tokens
        self.counters["num_recomputed_tokens"] += update.num_recomputed_tokens
        self.counters["num_generated_tokens"] += update.num_generated_tokens
        self.counters["num_steps"] += 1
        for num_tokens in update.num_tokens_per_decode:
            self.spec.record_decode(num_tokens)
        for num_drafts, num_accepted in update.verifications:
            self.spec.record_verification(num_drafts, num_accepted)
            if self.governor is not None:
                self.governor.observe_verification(num_drafts, num_accepted)

    def _deltas(
        self, update: StepUpdate, logprobs: dict[str, list[TokenLogprob]]
    ) -> list[TokenDelta]:
        # Requests still running first, then the finished ones, each in the order they ran.
        running, finished = [], []
        for output in update.outputs:
            request = output.request
            delta = TokenDelta(request.request_id, output.new_token_ids)
            entries = logprobs.get(request.request_id)
            if entries is not None:  # cut where a stop ended the request's ids
                delta.logprobs = entries[: len(output.new_token_ids)]
            if request.num_emitted_tokens == 0:
                delta.num_cached_tokens = request.metrics.num_cached_tokens
            request.num_emitted_tokens += len(output.new_token_ids)
            if output.finish_reason is None:
                running.append(delta)
            else:
                finished.append(self._release(request, delta))
        return running + finished

    # -- speculative decoding ------------------------------------------------------------

    def _propose_drafts(self) -> None:
        # Drafters read only committed ids (all_token_ids): never a forced id ahead.
        # Constrained requests get no drafts: a draft the grammar rejects would be
        # verified for nothing, and checking drafts against the matcher is not built yet.
        requests = [
            r
            for r in self.scheduler.running
            if r.is_decoding and r.num_draft_slots and r.grammar is None
        ]
        if not requests:
            return
        limit = self.config.num_speculative_tokens
        if self.governor is not None:
            limit = self.governor.draft_length(len(requests))
            if limit == 0:
                return
        max_tokens = [min(limit, r.num_draft_slots) for r in requests]
        assert self.drafter is not None  # step() proposes only with a drafter
        for request, k, draft in zip(
            requests, max_tokens, self.drafter.propose(requests, max_tokens), strict=True
        ):
            request.draft_token_ids = list(draft.token_ids[:k])
            request.draft_probs = None if draft.probs is None else draft.probs[:k]

    def _select_tokens(self, logits, requests: list[Request]) -> list[list[int]]:
        """The ids each sampled request commits this step: one sampled id for a plain row,
        accepted drafts plus one for a verification (its 1 + k rows)."""
        plain_rows, plain_requests, row = [], [], 0
        spans: list[tuple[int, int]] = []
        for request in requests:
            num_rows = 1 + len(request.draft_token_ids)
            spans.append((row, num_rows))
            if num_rows == 1:
                plain_rows.append(row)
                plain_requests.append(request)
            row += num_rows
        # Every row plain (no verification this step): no copy of the (N, vocab) logits.
        plain_logits = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
        plain = iter(sample(plain_logits, plain_requests, self.generator))
        committed = []
        for request, (row, num_rows) in zip(requests, spans, strict=True):
            if num_rows == 1:
                committed.append([next(plain)])
            else:
                committed.append(self._verify(request, logits[row : row + num_rows]))
        return committed

    def _verify(self, request: Request, rows) -> list[int]:
        drafts = request.draft_token_ids
        forced = request.forced_output_ids
        if forced is not None:
            n = len(request.output_token_ids)
            return accept_matching(drafts, list(forced[n : n + len(drafts) + 1]))
        if request.sampling.greedy:
            return accept_matching(drafts, rows.argmax(dim=-1).tolist())
        probs = sampling_probs(rows, request.sampling)
        gen = request.generator or self.generator
        return rejection_sample(probs, drafts, request.draft_probs, gen)

    def _finish(self, request: Request, reason: str, error=None) -> None:
        """Abort or fail a request between or during steps; its delta goes out next."""
        if request.is_finished:
            return
        self.scheduler.finish(request, reason)
        self._pending.append(self._release(request, TokenDelta(request.request_id, []), error))

    def _release(self, request: Request, delta: TokenDelta, error=None) -> TokenDelta:
        """Forget a request the scheduler has finished; `delta` becomes its last."""
        if self.drafter is not None:
            self.drafter.on_finished(request)
        self.requests.pop(request.request_id, None)
        self.pauses.finished(request.session_key, request.block_hashes)
        if request.num_emitted_tokens == 0 and delta.num_cached_tokens is None:
            delta.num_cached_tokens = request.metrics.num_cached_tokens
        delta.finish_reason = request.finish_reason
        delta.error = error
        delta.metrics = request.finalize_metrics()
        delta.kv_transfer_params = self.connector.on_finish(request)
        if request.finish_reason != FINISH_ABORT:
            self.counters["num_requests_finished"] += 1
        self.counters["num_prompt_tokens"] += request.num_prompt_tokens
        self.counters["num_cached_prompt_tokens"] += request.metrics.num_cached_tokens
        return delta

    def _take_pending(self) -> list[TokenDelta]:
        pending, self._pending = self._pending, []
        return pending

    # -- accounting ------------------------------------------------------------------------

    def stats(self) -> dict:
        pool = self.pool
        queried = self.kv.num_query_tokens
        return {
            "model": str(self.model_path),
            "role": self.connector.role,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks_total": pool.num_blocks,
            "num_kv_blocks_free": pool.num_free_blocks,
            "num_kv_blocks_used": pool.num_used_blocks,
            "num_kv_blocks_cached": pool.num_cached_blocks,
            "kv_block_usage": pool.num_used_blocks / pool.num_blocks,
            "num_kv_evictions": pool.num_evictions,
            "num_kv_keeps_broken": pool.num_keeps_broken,
            **self.pauses.counters,
            "prefix_cache_query_tokens": queried,
            "prefix_cache_hit_tokens": self.kv.num_hit_tokens,
            "prefix_cache_hit_rate": self.kv.num_hit_tokens / queried if queried else 0.0,
            "external_kv_hit_tokens": self.kv.num_external_hit_tokens,
            "kv_tier_prefetches": self.kv.num_prefetches,
            "kv_tier_load_timeouts": self.scheduler.num_load_timeouts,
            "num_preemptions": self.scheduler.num_preemptions,
            "step_time_s_total": self.step_time_s,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            **self.counters,
            **self.spec.to_stats(),
            "num_grammars_compiled": self.grammars.num_compiled,
            **self.masks.stats(),
            **self.connector.stats(),
        }

    def enable_kv_events(self) -> None:
        """Keep KV events for a consumer (they are dropped until one asks)."""
        self.pool.record_events = True
        self.connector.record_events = True

    def take_kv_events(self):
        return self.pool.take_events() + self.connector.take_events()

    def publish_kv_events(self) -> None:
        """Send the events since the last call to the ZMQ publisher, if there is one."""
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.take_kv_events())

    def close(self) -> None:
        """Finish the KV tiers' queued writes and stop their threads."""
        self.connector.close()

    def generate(self, requests: list[GenerateRequest]) -> dict[str, list[TokenDelta]]:
        """Run requests to completion (offline use, tests, benchmarks)."""
        for request in requests:
            self.add_request(request)
        results: dict[str, list[TokenDelta]] = {r.request_id: [] for r in requests}
        while self.has_unfinished_requests():
            for delta in self.step():
                results[delta.request_id].append(delta)
        return results
