"""One response's generation: engine deltas in, neutral output events out.

`Generation.events` dispatches to the engine and starts the input check at the same moment
(the check hides behind prefill); it coalesces the deltas that are ready into one batch of
events; it detokenizes (DecodeStream's algorithm, one decode per batch) and parses
`<tool_call>` blocks; under the `hold` policy it keeps output back until the check passes,
and a failed check ends the response with `content_filter` (the engine request aborted).
The last batch holds `ResponseFinished`; `completed_normally` then says whether the
conversation may be saved (not after a failure or a content filter).

A call to a tool the gateway runs itself (a hosted tool, `runs_here`) ends this generation
early instead: the call is emitted, the engine request aborted, and `pending_call` holds
it with no `ResponseFinished`; the pipeline runs the tool and starts the next
generation of the same response from a prompt that holds the call and its output.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from once.gateway.detok import IncrementalDetokenizer
from once.gateway.hosted.mcp_policy import approval_rule
from once.gateway.metrics import GatewayMetrics
from once.gateway.output import (
    COMPLETED,
    FAILED,
    INCOMPLETE,
    OutputBuilder,
    OutputEvent,
    TextLogprob,
    Usage,
)
from once.gateway.prepare import Prepared
from once.gateway.prompt.tokens import BuiltPrompt
from once.gateway.prompt.tool_items import call_item, declared_types
from once.gateway.prompt.toolcalls import (
    TextDelta,
    ToolCallMalformed,
    ToolCallParsed,
    ToolCallStreamParser,
)
from once.gateway.safety.checker import SafetyVerdict
from once.gateway.safety.gate import SafetyGate
from once.gateway.stops import StopMatcher
from once.gateway.validation import safety_texts
from once.protocol.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineClient,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
)
from once.protocol.errors import OnceError

EventBatch = list[OutputEvent]


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        prepared: Prepared,
        sampling: SamplingParams,
        metrics: GatewayMetrics,
        *,
        stream_interval_s: float,
        keep_until_done: Callable[[asyncio.Task], None],
        built: BuiltPrompt | None = None,
        runs_here: Callable[[dict], bool] = lambda item: False,
        usage_before: Usage = Usage(0, 0, 0),
    ):
        self.engine = engine
        self.prepared = prepared
        self.built = built or prepared.built  # this step's prompt
        self.runs_here = runs_here
        self.usage_before = usage_before  # of the response's earlier steps
        self.pending_call: dict | None = None
        self.sampling = sampling
        self.metrics = metrics
        self.stream_interval_s = stream_interval_s
        self.keep_until_done = keep_until_done
        self.output: OutputBuilder = prepared.output
        self.model = prepared.model
        self.request_id = prepared.response_id
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.completed_normally = False
        self.check: asyncio.Task[SafetyVerdict] | None = None
        self.first_token_at: float | None = None
        self.started = 0.0
        self.detok_cpu_s = 0.0  # wall time of the synchronous sections, see _events
        self.last_batch_at = 0.0
        self.engine_done = asyncio.Event()
        self._interval_waiter: asyncio.Future | None = None  # see _next
        self.stops = StopMatcher(prepared.request.stop)
        self.pending_logprobs: list[TextLogprob] = []  # tokens not yet given to a text delta
        # What kinds of tool the model may call (tool_items.py), from everything known, and
        # which MCP calls wait for approval (by the listings so far, this response's too).
        known_items = prepared.items if prepared.items is not None else prepared.new_items
        self.declared = declared_types(prepared.request.prompt_tools, known_items)
        self.needs_approval = approval_rule(
            prepared.request.tools, known_items, prepared.output.items
        )

    def usage(self) -> Usage:
        before = self.usage_before
        return Usage(
            before.input_tokens + len(self.built.prompt_ids),
            before.cached_tokens + self.cached_tokens,
            before.output_tokens + len(self.output_ids),
        )

    async def events(self) -> AsyncIterator[EventBatch]:
        prepared = self.prepared
        yield self.output.started()
        engine_request = GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=tuple(self.built.prompt_ids),
            sampling=self.sampling,
            session_key=prepared.request.prompt_cache_key,
            cache_salt=prepared.tenant.name,
        )
        deltas: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(engine_request, deltas))
        if self.model.safety is not None:
            texts = safety_texts(prepared.new_items)
            self.check = asyncio.create_task(self.model.safety.check(texts))
        try:
            async for batch in self._events(deltas):
                if batch:
                    yield batch
        except OnceError as e:
            self.metrics.failed.inc()
            error = {"code": e.code, "message": e.message}
            yield self.output.finish(FAILED, self.usage(), error=error)
        finally:
            if not pump.done():
                if self.engine_done.is_set():
                    # The engine finished; the pump is only closing its stream (for a
                    # remote engine, handing the HTTP connection back to its pool). Cut
                    # there by a cancel, the connection would never go back; and a
                    # finished request has nothing to abort.
                    self.keep_until_done(pump)
                else:
                    pump.cancel()
                    await self.engine.abort(self.request_id)
            if self.check is not None:
                self.check.cancel()

    async def _events(self, deltas: asyncio.Queue) -> AsyncIterator[EventBatch]:
        """Engine deltas -> event batches, through the safety gate: until the last delta
        (or a hosted call), batch what is ready and pass it through the gate; when the
        verdict comes, release or filter; at the end, wait for a verdict still due, then
        finish."""
        safety = self.model.safety
        gate = SafetyGate(
            self.check,
            hold=safety is not None and safety.policy == "hold",
            on_verdict=self._record_verdict,
        )
        detok = IncrementalDetokenizer(
            self.model.tokenizer.backend_tokenizer,
            prefix_ids=self.built.prompt_ids[-8:],
        )
        parser = ToolCallStreamParser() if self.prepared.request.tool_choice != "none" else None
        self.started = time.perf_counter()
        done = False
        while not done:
            if gate.verdict_ready():
                released = await gate.settle()
                if gate.failed:
                    yield self._filtered(gate.output_dropped)
                    return
                yield released
            items = await self._next(deltas, gate.check)
            if items is None:
                continue  # the verdict came first: handled at the loop top
            # Wall time of this synchronous section stands for its CPU (thread_time is a
            # syscall costing ~20 us here): detokenize, parse, build the batch's events.
            t0 = time.perf_counter()
            events, done = self._on_deltas(items, detok, parser)
            self.detok_cpu_s += time.perf_counter() - t0
            if self.first_token_at is None and self.output_ids:
                self.first_token_at = time.perf_counter()
            yield gate.admit(events)
        released = await gate.settle()  # the output ended before the check did
        if gate.failed:
            yield self._filtered(gate.output_dropped)
            return
        yield released
        if self.pending_call is not None:  # a hosted call: the pipeline takes it from here
            return
        t0 = time.perf_counter()
        final = self._finish(detok, parser)
        self.detok_cpu_s += time.perf_counter() - t0
        self.completed_normally = True
        yield final

    def _record_verdict(self, verdict: SafetyVerdict) -> None:
        self.metrics.record_safety(verdict, self.first_token_at, self.started)

    async def _pump(self, engine_request: GenerateRequest, deltas: asyncio.Queue) -> None:
        try:
            async for delta in self.engine.generate(engine_request):
                deltas.put_nowait(delta)
                if delta.finished:
                    self._set_engine_done()
        except Exception as e:  # noqa: BLE001 - handed to the consumer as a failure
            deltas.put_nowait(e)
        self._set_engine_done()

    def _set_engine_done(self) -> None:
        self.engine_done.set()
        if self._interval_waiter is not None and not self._interval_waiter.done():
            self._interval_waiter.set_result(None)  # the last delta ends the interval early

    async def _next(self, deltas: asyncio.Queue, check) -> list | None:
        """All deltas available now (coalesced), or None when the check finishes first.

        Stream interval: after a batch, the next one is not taken before `stream_interval_s`
        has passed; what the engine delivered meanwhile goes out together. A paced engine (a
        token every few ms or more) is never delayed: its delta finds the interval over. A
        burst becomes one batch per interval, and the consumer wakes once per batch (on the
        interval's timer), not once per delta; the engine's last delta ends the wait early,
        so the final event is never held back. A check that finishes during the wait is
        handled after it (at most one interval later).
        """
        wait = self.last_batch_at + self.stream_interval_s - time.perf_counter()
        if wait > 0 and not self.engine_done.is_set():
            # A future and a timer, not wait_for(Event.wait()), which costs a task per batch.
            loop = asyncio.get_running_loop()
            self._interval_waiter = waiter = loop.create_future()
            timer = loop.call_later(wait, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._interval_waiter = None
        items = []
        if deltas.empty():
            if check is not None and not check.done():
                getter = asyncio.ensure_future(deltas.get())
                try:
                    done, _ = await asyncio.wait(
                        {getter, check}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    # Also when this response is cancelled (its client gone): a getter
                    # left waiting on a queue nothing else holds is destroyed pending.
                    getter.cancel()  # a no-op once it is done
                if getter not in done:
                    return None
                items.append(getter.result())
            elif check is not None:
                return None  # the check finished first: the caller handles it
            else:
                items.append(await deltas.get())
        while not deltas.empty():
            items.append(deltas.get_nowait())
        self.last_batch_at = time.perf_counter()
        return items

    def _on_deltas(self, items: list, detok, parser) -> tuple[EventBatch, bool]:
        new_ids: list[int] = []  # the batch's ids, detokenized in one call
        for delta in items:
            if isinstance(delta, OnceError):
                raise delta
            if isinstance(delta, BaseException):
                raise OnceError(f"the engine failed: {delta!r}") from delta
            assert isinstance(delta, TokenDelta)
            if delta.num_cached_tokens is not None:
                self.cached_tokens = delta.num_cached_tokens
            self.output_ids.extend(delta.token_ids)
            new_ids.extend(delta.token_ids)
            if delta.logprobs:
                eos = self.model.builder.eos_ids  # the stop token is no part of the text
                self.pending_logprobs.extend(
                    self._text_logprob(lp) for lp in delta.logprobs if lp.token_id not in eos
                )
            if delta.finished:
                self.finish_reason = delta.finish_reason
                if delta.finish_reason == FINISH_ERROR:
                    error = delta.error or {}
                    raise OnceError(error.get("message", "the engine failed this request"))
                break
        text = self.stops.push(detok.push(new_ids)) if new_ids else ""
        if self.stops.matched is not None:
            self.finish_reason = FINISH_STOP  # the engine request is aborted on the way out
        events = self._text_events(text, parser) if text else []
        return events, self.finish_reason is not None or self.pending_call is not None

    def _text_logprob(self, logprob: TokenLogprob) -> TextLogprob:
        decode = self.model.tokenizer.backend_tokenizer.decode
        top = tuple((decode([token_id]), value) for token_id, value in logprob.top_logprobs)
        return TextLogprob(decode([logprob.token_id]), logprob.logprob, top)

    def _take_logprobs(self) -> tuple[TextLogprob, ...] | None:
        if self.prepared.request.logprobs is None:
            return None
        taken, self.pending_logprobs = tuple(self.pending_logprobs), []
        return taken

    def _text_events(self, text: str, parser) -> EventBatch:
        if parser is None:
            return self.output.text(text, self._take_logprobs())
        events: EventBatch = []
        for parsed in parser.feed(text):
            events.extend(self._parsed_events(parsed))
        return events

    def _parsed_events(self, parsed) -> EventBatch:
        if isinstance(parsed, TextDelta):
            return self.output.text(parsed.text, self._take_logprobs()) if parsed.text else []
        if isinstance(parsed, ToolCallParsed):
            if self.pending_call is not None:
                return []  # past a hosted call: the next step writes what follows it
            item = call_item(
                parsed.name, parsed.arguments, parsed.input, self.declared, self.needs_approval
            )
            if item is None:  # a typed tool's call that does not fit it
                return self.output.text(parsed.raw)
            if self.runs_here(item):
                events = self.output.hosted_call(item)
                self.pending_call = self.output.items[-1]
                return events
            if self.output.num_client_calls and not self.prepared.request.parallel_tool_calls:
                return []  # parallel_tool_calls=false: the first call only
            return self.output.tool_call(item)
        return self.output.text(parsed.raw)  # malformed: shown as the text it was

    def _finish(self, detok, parser) -> EventBatch:
        events: EventBatch = []
        tail = self.stops.push(detok.flush()) + self.stops.flush()
        if tail:
            events.extend(self._text_events(tail, parser))
        if parser is not None:
            for parsed in parser.finish():
                if isinstance(parsed, ToolCallMalformed) and self.finish_reason == FINISH_LENGTH:
                    continue  # a call the output limit cut off: its markup is no text
                events.extend(self._parsed_events(parsed))
        usage = self.usage()
        self.metrics.record_usage(usage)
        if self.finish_reason == FINISH_LENGTH:
            events.extend(self.output.finish(INCOMPLETE, usage, reason="max_output_tokens"))
        elif self.finish_reason == FINISH_ABORT:
            events.extend(self.output.finish(INCOMPLETE, usage, reason="cancelled"))
        else:
            stop = self.stops.matched
            events.extend(self.output.finish(COMPLETED, usage, stop_sequence=stop))
        return events

    def _filtered(self, drop_output: bool) -> EventBatch:
        """The input check failed: stop the engine and end with content_filter."""
        self.metrics.content_filtered.inc()
        if drop_output:
            self.output.discard()  # under `hold` nothing was shown: the response has none
        return self.output.finish(INCOMPLETE, self.usage(), reason="content_filter")


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
