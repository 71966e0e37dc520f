"""A scripted `EngineClient`: replays canned outputs with realistic accounting.

The fake that plugs into the engine seam (protocol/engine.py), so it lives beside it and
imports only the protocol: every layer above inference (gateway, router, agent, the engine
server) tests against it instead of a model, without importing once.engine. It behaves
like the real engine where callers can observe it:

- Output: `forced_output_ids` when the request has them, else the next scripted output
  (a list consumed in order, or a callable of the request), else an echo of the prompt.
  A constraint (`SamplingParams.constraint`) is accepted and ignored: the script is
  played as written (tests above the engine check that constraints reach it, not that a
  fake follows them). Stop conditions apply as in sampling: a stop token, or eos unless
  `ignore_eos`, ends the request with finish "stop" and is *included* as the last
  emitted id (vLLM keeps it in `token_ids` too). Running out of `max_tokens`, of the
  script, or of `max_model_len` ends it with finish "length".
- Prefix cache: chained hashes of full blocks (`protocol/kv_blocks.py`, the real engine's
  scheme, so a router's index agrees with it), the first salted with `cache_salt`, so
  `num_cached_tokens` on the first delta is the longest cached full-block prefix. As in
  vLLM, at least one prompt token is always computed, and blocks filled by output tokens
  are cached too (so the next turn of a conversation hits them).
- Logprobs (`SamplingParams.logprobs` = k): fake but deterministic, so layers above can
  check they carry them: each emitted id has logprob 0.0 (the script is certain) and its
  top k are the id itself at 0.0, then the next ids up, id + i at -i (see
  `scripted_logprobs`); nothing when the request did not ask.
- Timing: `ttft_s` before the first delta, `token_latency_s` per later token (a fixed
  token rate of 1 / token_latency_s per stream); `abort()` interrupts either wait at once
  and ends the stream with finish "abort".
- History: `requests` and `finish_reasons` record every request for tests to inspect;
  `keep_history=False` turns that off, so a long-running server (a load test) holds
  nothing per finished request.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence

from once.protocol.engine import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    RequestMetrics,
    TokenDelta,
    TokenLogprob,
)
from once.protocol.errors import ContextLengthExceededError, InvalidRequestError, OnceError
from once.protocol.kv_blocks import block_hashes

Script = Callable[[GenerateRequest], Sequence[int]] | Sequence[Sequence[int]] | None


def scripted_logprobs(token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """The scripted engine's logprobs: each id certain (0.0), its k alternatives the id
    itself and the ids after it, id + i at logprob -i."""
    return [
        TokenLogprob(token_id, 0.0, tuple((token_id + i, -float(i)) for i in range(k)))
        for token_id in token_ids
    ]


class ScriptedEngine:
    def __init__(
        self,
        script: Script = None,
        *,
        ttft_s: float = 0.0,
        token_latency_s: float = 0.0,
        eos_token_id: int | None = None,
        block_size: int = 16,
        max_model_len: int = 8192,
        tokens_per_delta: int = 1,
        max_cached_blocks: int | None = None,
        keep_history: bool = True,
    ):
        if block_size < 1 or tokens_per_delta < 1 or max_model_len < 1:
            raise ValueError("block_size, tokens_per_delta and max_model_len must be >= 1")
        self.script = script
        self.ttft_s = ttft_s
        self.token_latency_s = token_latency_s
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.tokens_per_delta = tokens_per_delta
        self.max_cached_blocks = max_cached_blocks
        self.keep_history = keep_history
        self._next_script_index = 0
        self._cached_blocks: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self._abort_events: dict[str, asyncio.Event] = {}
        self._num_running_blocks: dict[str, int] = {}  # request id -> blocks it holds
        self._num_evictions = 0
        # What tests inspect: every request received, and how each one ended.
        self.requests: list[GenerateRequest] = []
        self.finish_reasons: dict[str, str] = {}
        self.pauses: list[tuple[str, float]] = []  # pause hints: (session key, seconds)
        self._counters = dict.fromkeys(
            (
                "num_requests_finished",
                "num_requests_aborted",
                "num_prompt_tokens",
                "num_cached_prompt_tokens",
                "num_computed_prompt_tokens",
                "num_generated_tokens",
            ),
            0,
        )

    # -- EngineClient -------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        arrival = time.monotonic()
        if self.keep_history:
            self.requests.append(request)
        prompt = request.prompt_token_ids
        if len(prompt) > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {len(prompt)} tokens; this model's maximum context length is "
                f"{self.max_model_len}",
                param="prompt_token_ids",
            )
        if request.request_id in self._abort_events:
            raise InvalidRequestError(
                f"request {request.request_id!r} is already running", param="request_id"
            )
        output, finish_reason = self._plan_output(request)
        num_cached = self._match_prefix(prompt, request.cache_salt)

        abort_event = asyncio.Event()
        self._abort_events[request.request_id] = abort_event
        self._num_running_blocks[request.request_id] = -(-len(prompt) // self.block_size)
        emitted: list[int] = []
        token_times: list[float] = []
        finished = False
        step = self.tokens_per_delta
        chunks = [output[i : i + step] for i in range(0, len(output), step)] or [[]]
        try:
            delay = self.ttft_s
            for index, chunk in enumerate(chunks):
                if await self._wait_or_abort(abort_event, delay):
                    break
                emitted.extend(chunk)
                token_times.append(time.monotonic())
                delay = self.token_latency_s * len(chunk)
                delta = TokenDelta(request.request_id, chunk)
                if request.sampling.logprobs is not None and chunk:
                    delta.logprobs = scripted_logprobs(chunk, request.sampling.logprobs)
                if index == 0:
                    delta.num_cached_tokens = num_cached
                if index == len(chunks) - 1:
                    finished = True
                    delta.finish_reason = finish_reason
                    delta.metrics = self._finish(
                        request, emitted, finish_reason, num_cached, arrival, token_times
                    )
                yield delta
            if not finished:  # aborted between deltas
                finished = True
                metrics = self._finish(
                    request, emitted, FINISH_ABORT, num_cached, arrival, token_times
                )
                yield TokenDelta(
                    request.request_id,
                    [],
                    finish_reason=FINISH_ABORT,
                    num_cached_tokens=num_cached if not emitted else None,
                    metrics=metrics,
                )
        finally:
            self._abort_events.pop(request.request_id, None)
            self._num_running_blocks.pop(request.request_id, None)
            if not finished:  # the consumer closed the stream or was cancelled
                self._finish(request, emitted, FINISH_ABORT, num_cached, arrival, token_times)

    async def abort(self, request_id: str) -> None:
        # Unknown or already-finished ids are a no-op, as in vLLM: an abort can race with
        # the request's own finish.
        event = self._abort_events.get(request_id)
        if event is not None:
            event.set()

    async def pause_session(self, session_key: str, expected_s: float) -> None:
        self.pauses.append((session_key, expected_s))  # kept for tests; nothing is cached

    async def stats(self) -> dict:
        # The real engine's keys (core.LLMEngine.stats), minus what a fake cannot know.
        counters = self._counters
        num_prompt = counters["num_prompt_tokens"]
        num_hit = counters["num_cached_prompt_tokens"]
        return {
            "num_running": len(self._abort_events),
            "num_waiting": 0,
            **counters,
            "num_recomputed_tokens": 0,
            "num_preemptions": 0,
            "num_kv_blocks_used": sum(self._num_running_blocks.values()),
            "num_kv_blocks_cached": len(self._cached_blocks),
            "num_kv_evictions": self._num_evictions,
            "prefix_cache_query_tokens": num_prompt,
            "prefix_cache_hit_tokens": num_hit,
            "prefix_cache_hit_rate": num_hit / num_prompt if num_prompt else 0.0,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
        }

    # -- internals ----------------------------------------------------------------------

    def _plan_output(self, request: GenerateRequest) -> tuple[list[int], str]:
        candidate: Sequence[int]
        if request.forced_output_ids is not None:
            candidate = request.forced_output_ids
        elif self.script is None:
            candidate = request.prompt_token_ids
        elif callable(self.script):
            candidate = self.script(request)
        else:
            if self._next_script_index >= len(self.script):
                raise OnceError(f"scripted engine ran out of outputs ({len(self.script)} used)")
            candidate = self.script[self._next_script_index]
            self._next_script_index += 1

        sampling = request.sampling
        stop_ids = set(sampling.stop_token_ids)
        if self.eos_token_id is not None and not sampling.ignore_eos:
            stop_ids.add(self.eos_token_id)
        limit = min(sampling.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        output: list[int] = []
        for token_id in candidate:
            if len(output) >= limit:
                break
            output.append(int(token_id))
            if token_id in stop_ids:
                return output, FINISH_STOP
        return output, FINISH_LENGTH

    def _match_prefix(self, prompt: Sequence[int], salt: str | None) -> int:
        # The last prompt token is always computed (its logits are needed), so match
        # against prompt[:-1], like vLLM's max_cache_hit_length.
        num_blocks = 0
        for block_hash in block_hashes(prompt[:-1], self.block_size, salt):
            if block_hash not in self._cached_blocks:
                break
            self._cached_blocks.move_to_end(block_hash)
            num_blocks += 1
        return num_blocks * self.block_size

    def _insert_blocks(self, token_ids: Sequence[int], salt: str | None) -> None:
        for block_hash in block_hashes(token_ids, self.block_size, salt):
            self._cached_blocks[block_hash] = None
            self._cached_blocks.move_to_end(block_hash)
        if self.max_cached_blocks is not None:
            while len(self._cached_blocks) > self.max_cached_blocks:
                self._cached_blocks.popitem(last=False)
                self._num_evictions += 1

    async def _wait_or_abort(self, abort_event: asyncio.Event, delay: float) -> bool:
        """Sleep `delay` seconds; True when aborted meanwhile (or before)."""
        if abort_event.is_set():
            return True
        if delay <= 0:
            await asyncio.sleep(0)  # stay cooperative like a real step loop
            return abort_event.is_set()
        try:
            await asyncio.wait_for(abort_event.wait(), timeout=delay)
        except TimeoutError:
            return False
        return True

    def _finish(
        self,
        request: GenerateRequest,
        emitted: list[int],
        finish_reason: str,
        num_cached: int,
        arrival: float,
        token_times: list[float],
    ) -> RequestMetrics:
        num_prompt = len(request.prompt_token_ids)
        # The KV of the last emitted token was never computed, so it is not cached.
        self._insert_blocks(list(request.prompt_token_ids) + emitted[:-1], request.cache_salt)
        if self.keep_history:
            self.finish_reasons[request.request_id] = finish_reason
        counters = self._counters
        counters["num_requests_finished"] += 1
        counters["num_requests_aborted"] += int(finish_reason == FINISH_ABORT)
        counters["num_prompt_tokens"] += num_prompt
        counters["num_cached_prompt_tokens"] += num_cached
        counters["num_computed_prompt_tokens"] += num_prompt - num_cached
        counters["num_generated_tokens"] += len(emitted)
        now = time.monotonic()
        # token_times holds one time per delta; later deltas may carry several tokens.
        num_later_tokens = len(emitted) - len(emitted[: self.tokens_per_delta])
        decode_s = token_times[-1] - token_times[0] if token_times else 0.0
        return RequestMetrics(
            num_prompt_tokens=num_prompt,
            num_cached_tokens=num_cached,
            num_computed_tokens=num_prompt - num_cached,
            num_output_tokens=len(emitted),
            ttft_s=(token_times[0] - arrival) if token_times else 0.0,
            mean_token_latency_s=decode_s / num_later_tokens if num_later_tokens else 0.0,
            e2e_s=now - arrival,
        )
