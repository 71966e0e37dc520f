"""An `EngineClient` wrapper that forces the recorded outputs and records what ran.

The gateway does not carry forced outputs from the API, so the replay puts this wrapper
between the gateway and the engine: every request carries the session's
`prompt_cache_key` (the gateway passes it as `session_key`), and the wrapper attaches the
next recorded output of that session, in call order. It also keeps, per request, the
prompt the engine received and the engine's own accounting (`RequestMetrics`), which is
what the ledger's inference layer is built from.

Where the engine cannot be handed output ids (an OpenAI-compatible server such as vLLM),
`as_constraint` turns the forced ids into a constraint instead (vllm_pool.py's literal
grammar of their text), decoded greedily: the engine produces the recorded text itself.

A request that ends before it finished (an exception such as `EngineDeadError` from a
dead replica, a finish reason `error` or `abort`, or the caller going away) puts its
forced output back at the front of its session's queue: the caller's retry of the same
call forces the same output.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from once.protocol.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    EngineClient,
    GenerateRequest,
    OutputConstraint,
    RequestMetrics,
    TokenDelta,
)
from once.protocol.errors import InvalidRequestError


@dataclass
class EngineRecord:
    session_key: str
    request_id: str
    prompt_ids: tuple[int, ...]
    num_forced: int
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    finish_reason: str | None = None
    first_token_s: float | None = None  # wall time from dispatch to the first delta


class ForcedOutputEngine:
    def __init__(
        self,
        inner: EngineClient,
        as_constraint: Callable[[Sequence[int]], OutputConstraint] | None = None,
    ):
        self.inner = inner
        self.as_constraint = as_constraint
        self._outputs: dict[str, deque[tuple[int, ...]]] = {}
        self.records: list[EngineRecord] = []
        # Inter-token latency as the gateway sees it: per output token after a request's
        # first, the gap since the previous delta, split evenly over a delta's tokens.
        self.token_gaps_s: list[float] = []

    def expect(self, session_key: str, outputs: Sequence[Sequence[int]]) -> None:
        """The outputs to force for a session's calls, in the order they will arrive."""
        self._outputs[session_key] = deque(tuple(ids) for ids in outputs)

    def remaining(self, session_key: str) -> int:
        return len(self._outputs.get(session_key, ()))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        queue = self._outputs.get(request.session_key or "")
        if not queue:
            raise InvalidRequestError(
                f"no recorded output left for session {request.session_key!r}",
                param="prompt_cache_key",
            )
        forced = queue.popleft()
        record = EngineRecord(
            request.session_key or "", request.request_id, request.prompt_token_ids, len(forced)
        )
        self.records.append(record)
        started = time.perf_counter()
        last_token_at: float | None = None
        forced_request = self._forcing(request, forced)
        completed = False
        try:
            # aclosing: closed with this generator, the inner stream (a routed request's
            # HTTP response) is closed now, not whenever the garbage collector finds it.
            # EngineClient.generate is declared an AsyncIterator; every implementation is an
            # async generator, which has the aclose this needs.
            deltas_in = self.inner.generate(forced_request)
            async with contextlib.aclosing(deltas_in) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    if delta.token_ids:
                        now = time.perf_counter()
                        if record.first_token_s is None:
                            record.first_token_s = now - started
                        elif last_token_at is not None:
                            gap = (now - last_token_at) / len(delta.token_ids)
                            self.token_gaps_s.extend([gap] * len(delta.token_ids))
                        last_token_at = now
                    if delta.num_cached_tokens is not None:
                        record.num_cached_tokens = delta.num_cached_tokens
                    if delta.finished:
                        record.finish_reason = delta.finish_reason
                        record.metrics = delta.metrics
                        completed = delta.finish_reason not in (FINISH_ERROR, FINISH_ABORT)
                    yield delta
        finally:
            if not completed:  # the call will be retried: it must force the same output
                queue.appendleft(forced)

    def _forcing(self, request: GenerateRequest, forced: tuple[int, ...]) -> GenerateRequest:
        if self.as_constraint is None:
            return replace(request, forced_output_ids=forced)
        sampling = replace(request.sampling, constraint=self.as_constraint(forced), temperature=0.0)
        return replace(request, sampling=sampling)

    def last_record(self, session_key: str) -> EngineRecord:
        """The newest request of one session (sessions may run at once)."""
        for record in reversed(self.records):
            if record.session_key == session_key:
                return record
        raise KeyError(f"no request recorded for session {session_key!r}")

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def pause_session(self, session_key: str, expected_s: float) -> None:
        pause = getattr(self.inner, "pause_session", None)
        if pause is not None:
            await pause(session_key, expected_s)

    async def stats(self) -> dict:
        return await self.inner.stats()
