"""The event loop of one response: engine deltas in, Responses events out.

`ResponsesService.stream_batches` runs one `StreamRunner` per response. It dispatches to
the engine and starts the input check (and, on a sample, the verification of an
incremental prompt) at the same moment; it coalesces the deltas that are ready into one
batch of events; it detokenizes (DecodeStream's algorithm, one decode per batch) and
parses `<tool_call>` blocks; under the `hold` policy it keeps output back until the check
passes. The conversation state is saved before the final event goes out, since a client
continues the moment it sees it.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from once.gateway.detok import IncrementalDetokenizer
from once.gateway.events import usage
from once.gateway.toolcalls import TextDelta, ToolCallParsed, ToolCallStreamParser
from once.gateway.validation import safety_texts
from once.protocol.engine import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, GenerateRequest
from once.protocol.errors import OnceError

if TYPE_CHECKING:  # responses.py imports this module
    from once.gateway.responses import Prepared, ResponsesService


class StreamRunner:
    """The event loop of one response: engine deltas in, Responses events out."""

    def __init__(self, service: "ResponsesService", prepared: "Prepared", connection):
        self.service = service
        self.prepared = prepared
        self.connection = connection
        self.builder = prepared.builder
        self.model = prepared.model
        self.request_id = self.builder.id
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.check: asyncio.Task | None = None
        self.first_token_at: float | None = None
        self.started = 0.0
        self.detok_cpu_s = 0.0
        self.last_batch_at = 0.0
        self.verification: asyncio.Task | None = None
        self.engine_done = asyncio.Event()
        self._interval_waiter: asyncio.Future | None = None  # see _next

    async def run(self) -> AsyncIterator[list[dict]]:
        service, prepared = self.service, self.prepared
        request = prepared.request
        yield self.builder.started()
        engine_request = GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=tuple(prepared.built.prompt_ids),
            sampling=service.sampling(prepared),
            session_key=request.prompt_cache_key,
            cache_salt=prepared.tenant.name,
        )
        deltas: asyncio.Queue = asyncio.Queue()
        # Dispatch and the input check start together: the check hides behind prefill.
        pump = asyncio.create_task(self._pump(engine_request, deltas))
        self.verification = service.start_verification(prepared)
        if self.model.safety is not None:
            # Warm-ups too: their items join the chain, and continuations check only theirs.
            texts = safety_texts(prepared.new_items)
            self.check = asyncio.create_task(self.model.safety.check(texts))
        try:
            async for batch in self._events(deltas):
                yield batch
        except OnceError as e:
            service.metrics.failed.inc()
            used = usage(len(prepared.built.prompt_ids), self.cached_tokens, len(self.output_ids))
            error = {"code": e.code, "message": e.message}
            yield self.builder.finished("failed", used, error=error)
        finally:
            if not pump.done():
                if self.engine_done.is_set():
                    # The engine finished; the pump is only closing its stream (for a
                    # remote engine, handing the HTTP connection back to its pool). Cut
                    # there by a cancel, the connection would never go back; and a
                    # finished request has nothing to abort.
                    service.keep_until_done(pump)
                else:
                    pump.cancel()
                    await service.engine.abort(self.request_id)
            if self.check is not None:
                self.check.cancel()

    async def _events(self, deltas: asyncio.Queue) -> AsyncIterator[list[dict]]:
        service, prepared = self.service, self.prepared
        hold = self.check is not None and self.model.safety.policy == "hold"
        held: list[dict] = []  # under `hold`: output waiting for the check to pass
        detok = IncrementalDetokenizer(
            self.model.tokenizer.backend_tokenizer,
            prefix_ids=prepared.built.prompt_ids[-8:],
        )
        parser = ToolCallStreamParser() if prepared.request.tool_choice != "none" else None
        self.started = time.perf_counter()
        done = False
        while not done:
            if self.check is not None and self.check.done():
                if await self._check_failed():
                    yield self._filtered(held if hold else [])
                    return
                hold = False
                yield held
                held = []
            items = await self._next(deltas, self.check)
            if items is None:
                continue  # the check finished first: handle it at the loop top
            # Wall time of this synchronous section stands for its CPU (thread_time is a
            # syscall costing ~20 us here): detokenize, parse, build the batch's events.
            t0 = time.perf_counter()
            events, done = self._on_deltas(items, detok, parser)
            self.detok_cpu_s += time.perf_counter() - t0
            if self.first_token_at is None and self.output_ids:
                self.first_token_at = time.perf_counter()
            if hold:
                held.extend(events)
            else:
                yield events
        if self.check is not None:  # the output ended before the check did
            if await self._check_failed():
                yield self._filtered(held if hold else [])
                return
            yield held
        final = self._finish(detok, parser)
        service._on_cpu("detokenize", self.detok_cpu_s, len(self.output_ids))
        prepared.cpu_s += self.detok_cpu_s
        # Saved before the final event goes out: a client continues as soon as it sees it.
        await service.save(prepared, self.output_ids, self.connection, self.verification)
        yield final

    async def _check_failed(self) -> bool:
        verdict = await self.check
        self.check = None
        self.service.metrics.record_safety(verdict, self.first_token_at, self.started)
        return verdict.flagged

    async def _pump(self, engine_request, deltas: asyncio.Queue) -> None:
        try:
            async for delta in self.service.engine.generate(engine_request):
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

    async def _next(self, deltas: asyncio.Queue, check):
        """All deltas available now (coalesced), or None when the check finishes first.

        Stream interval: after a batch, the next one is not taken before `stream_interval_s`
        has passed; what the engine delivered meanwhile goes out together. A paced engine (a
        token every few ms or more) is never delayed: its delta finds the interval over. A
        burst becomes one batch per interval, and the consumer wakes once per batch (on the
        interval's timer), not once per delta; the engine's last delta ends the wait early,
        so the final event is never held back. A check that finishes during the wait is
        handled after it (at most one interval later).
        """
        wait = self.last_batch_at + self.service.stream_interval_s - time.perf_counter()
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
                done, _ = await asyncio.wait({getter, check}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
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

    def _on_deltas(self, items, detok, parser) -> tuple[list[dict], bool]:
        events: list[dict] = []
        new_ids: list[int] = []  # the batch's ids, detokenized in one call
        for delta in items:
            if isinstance(delta, OnceError):
                raise delta
            if isinstance(delta, BaseException):
                raise OnceError(f"the engine failed: {delta!r}") from delta
            if delta.num_cached_tokens is not None:
                self.cached_tokens = delta.num_cached_tokens
            if self.prepared.request.generate:
                self.output_ids.extend(delta.token_ids)
                new_ids.extend(delta.token_ids)
            if delta.finished:
                self.finish_reason = delta.finish_reason
                if delta.finish_reason == FINISH_ERROR:
                    error = delta.error or {}
                    raise OnceError(error.get("message", "the engine failed this request"))
                break
        text = detok.push(new_ids) if new_ids else ""
        if text:
            events.extend(self._text_events(text, parser))
        return events, self.finish_reason is not None

    def _text_events(self, text: str, parser) -> list[dict]:
        if parser is None:
            return self.builder.text_delta(text)
        events: list[dict] = []
        for parsed in parser.feed(text):
            events.extend(self._parsed_events(parsed))
        return events

    def _parsed_events(self, parsed) -> list[dict]:
        if isinstance(parsed, TextDelta):
            return self.builder.text_delta(parsed.text) if parsed.text else []
        if isinstance(parsed, ToolCallParsed):
            calls = [o for o in self.builder.response["output"] if o["type"] == "function_call"]
            if calls and not self.prepared.request.parallel_tool_calls:
                return []  # parallel_tool_calls=false: the first call only
            return self.builder.function_call(parsed.name, parsed.arguments)
        return self.builder.text_delta(parsed.raw)  # malformed: shown as the text it was

    def _finish(self, detok, parser) -> list[dict]:
        events: list[dict] = []
        tail = detok.flush()
        if tail:
            events.extend(self._text_events(tail, parser))
        if parser is not None:
            for parsed in parser.finish():
                events.extend(self._parsed_events(parsed))
        built = self.prepared.built
        used = usage(len(built.prompt_ids), self.cached_tokens, len(self.output_ids))
        if not self.prepared.request.generate:
            used["output_tokens"] = used["total_tokens"] = 0
            used["total_tokens"] = len(built.prompt_ids)
            self.output_ids = []
        self.service.metrics.record_usage(used)
        if self.finish_reason == FINISH_LENGTH and self.prepared.request.generate:
            events.extend(self.builder.finished("incomplete", used, reason="max_output_tokens"))
        elif self.finish_reason == FINISH_ABORT:
            events.extend(self.builder.finished("incomplete", used, reason="cancelled"))
        else:
            events.extend(self.builder.finished("completed", used))
        return events

    def _filtered(self, held: list[dict]) -> list[dict]:
        """The input check failed: stop the engine and end with content_filter."""
        self.service.metrics.content_filtered.inc()
        built = self.prepared.built
        used = usage(len(built.prompt_ids), self.cached_tokens, len(self.output_ids))
        # Under `hold` nothing was shown; drop the held output from the stored response.
        if held:
            self.builder.response["output"] = []
            self.builder._open_message = None
        return self.builder.finished("incomplete", used, reason="content_filter")


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _finished(item) -> bool:
    return isinstance(item, BaseException) or item.finished
