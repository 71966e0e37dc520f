"""One response, from a validated request to its last event.

`ResponsesService.prepare` does everything that can still fail with an HTTP status:
semantic validation, finding the previous response, rendering and tokenizing (only the
new items of a continuation), the token rate limit. `ResponsesService.stream` then
dispatches to the engine and, at the same moment, starts the input safety check; it turns
engine deltas into Responses events (detokenized incrementally, tool calls parsed), and
finally saves the conversation state (in the store when `store`, and for the caller's
WebSocket connection always).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from once.gateway.auth import Tenant
from once.gateway.detok import IncrementalDetokenizer
from once.gateway.events import ResponseBuilder, usage
from once.gateway.model import ModelRuntime
from once.gateway.render import NotIncrementalError
from once.gateway.store import ResponseStore, StoredResponse
from once.gateway.tokens import BuiltPrompt, ConversationState, render_key
from once.gateway.toolcalls import TextDelta, ToolCallParsed, ToolCallStreamParser
from once.gateway.validation import safety_texts
from once.protocol.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    EngineClient,
    GenerateRequest,
    SamplingParams,
)
from once.protocol.errors import (
    ContextLengthExceededError,
    OnceError,
    PreviousResponseNotFoundError,
)
from once.protocol.responses import ResponsesRequest

logger = logging.getLogger(__name__)

# Renders above this many characters go to a worker thread; smaller ones cost less than
# the thread hop.
INLINE_RENDER_CHARS = 8192


@dataclass
class Prepared:
    request: ResponsesRequest
    tenant: Tenant
    model: ModelRuntime
    built: BuiltPrompt
    items: tuple[dict, ...] | None  # all items of the conversation, when known
    new_items: tuple[dict, ...]
    verify: bool
    builder: ResponseBuilder = field(init=False)
    # This response's CPU in the gateway's synchronous sections (thread time): render,
    # tokenize, detokenize, events; the transport adds its own framing.
    cpu_s: float = 0.0

    def __post_init__(self):
        self.builder = ResponseBuilder(self.request)


class ConnectionCache:
    """A WebSocket connection's own conversation states (works with store=false)."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self.states: dict[str, tuple[ConversationState, ResponsesRequest]] = {}

    def put(self, response_id: str, state: ConversationState, request: ResponsesRequest):
        self.states[response_id] = (state, request)
        while len(self.states) > self.capacity:
            self.states.pop(next(iter(self.states)))

    def get(self, response_id: str):
        return self.states.get(response_id)


class ResponsesService:
    def __init__(
        self,
        engine: EngineClient,
        models: dict[str, ModelRuntime],
        store: ResponseStore,
        metrics,
        *,
        verify_every: int = 32,
        stream_interval_s: float = 0.002,
        on_cpu: Callable[[str, float, int], None] | None = None,
    ):
        self.engine = engine
        self.models = models
        self.store = store
        self.metrics = metrics
        self.verify_every = max(0, verify_every)
        self.stream_interval_s = stream_interval_s
        self._num_incremental = 0
        self._on_cpu = on_cpu or (lambda stage, cpu_s, tokens: None)
        self._verifications: set[asyncio.Task] = set()

    # -- before the first event ------------------------------------------------------------

    async def prepare(
        self,
        request: ResponsesRequest,
        tenant: Tenant,
        connection: ConnectionCache | None = None,
    ) -> Prepared:
        """Semantic checks are the caller's (`check_semantics`), before auth, as specified."""
        model = self.models[request.model]
        key = render_key(request.model, request.instructions, request.tools)
        state, items = None, None
        if request.previous_response_id:
            state = await self._previous_state(request.previous_response_id, tenant, connection)
        built = None
        if state is not None and state.render_key == key:
            try:
                built = await self._run_cpu(
                    sum(len(str(i)) for i in request.input_items),
                    model.builder.continuation,
                    state,
                    request.tools,
                    request.input_items,
                )
            except NotIncrementalError:
                self.metrics.fallbacks.inc()
        if built is None:
            if state is not None:
                items = await self._conversation_items(state, request, tenant) + tuple(
                    request.input_items
                )
            else:
                items = tuple(request.input_items)
            built = await self._run_cpu(
                sum(len(str(i)) for i in items),
                model.builder.full,
                key,
                request.instructions,
                request.tools,
                items,
            )
        elif state.items is not None:
            items = state.items + tuple(request.input_items)
        self._check_length(built, request, model)
        self.metrics.record_build(built)
        verify = False
        if built.mode == "incremental" and self.verify_every:
            self._num_incremental += 1
            verify = self._num_incremental % self.verify_every == 0
        prepared = Prepared(request, tenant, model, built, items, request.input_items, verify)
        prepared.cpu_s = built.render_cpu_s + built.tokenize_cpu_s
        return prepared

    async def _previous_state(self, response_id, tenant, connection) -> ConversationState:
        if connection is not None and (cached := connection.get(response_id)) is not None:
            return cached[0]
        record = await self.store.get(response_id, tenant.name)
        if record is None:
            raise PreviousResponseNotFoundError(
                f"previous response with id {response_id!r} not found",
                param="previous_response_id",
            )
        return ConversationState(
            render_key=record.render_key,
            token_ids=record.prompt_token_ids + record.output_token_ids,
            after_output=bool(record.output_token_ids),
            items=None,
        )

    async def _conversation_items(self, state, request, tenant) -> tuple[dict, ...]:
        """Every item before this request: the chain of stored responses, walked back."""
        if state.items is not None:
            return state.items
        chain: list[StoredResponse] = []
        response_id = request.previous_response_id
        while response_id:
            record = await self.store.get(response_id, tenant.name)
            if record is None:
                raise PreviousResponseNotFoundError(
                    f"response {response_id!r} in the chain of previous_response_id expired",
                    param="previous_response_id",
                )
            chain.append(record)
            response_id = record.previous_response_id
        items: list[dict] = []
        for record in reversed(chain):
            items.extend(record.input_items)
            items.extend(record.response.get("output") or ())
        state.items = tuple(items)
        return state.items

    def _check_length(self, built: BuiltPrompt, request, model: ModelRuntime) -> None:
        room = model.max_model_len - len(built.prompt_ids)
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt is {len(built.prompt_ids)} tokens; this model's context is "
                f"{model.max_model_len}",
                param="input",
            )

    async def _run_cpu(self, size: int, fn, *args):
        """Render and tokenize inline when small, in a worker thread when large."""
        if size > INLINE_RENDER_CHARS:
            built = await asyncio.to_thread(fn, *args)
        else:
            built = fn(*args)
        self._on_cpu("render", built.render_cpu_s, built.num_tokenized)
        self._on_cpu("tokenize", built.tokenize_cpu_s, built.num_tokenized)
        return built

    # -- the stream ------------------------------------------------------------------------

    async def stream(
        self,
        prepared: Prepared,
        connection: ConnectionCache | None = None,
    ) -> AsyncIterator[dict]:
        async for batch in self.stream_batches(prepared, connection):
            for event in batch:
                yield event

    async def stream_batches(
        self,
        prepared: Prepared,
        connection: ConnectionCache | None = None,
    ) -> AsyncIterator[list[dict]]:
        """The events in batches: all that the deltas available at once produced.

        A transport writes a batch in one go (one SSE chunk), which is what keeps the
        cost per token low when the engine is ahead of the client.
        """
        async for batch in _StreamRunner(self, prepared, connection).run():
            if batch:
                yield batch

    def sampling(self, prepared: Prepared) -> SamplingParams:
        request, model = prepared.request, prepared.model
        room = model.max_model_len - len(prepared.built.prompt_ids)
        max_tokens = min(request.max_output_tokens or room, room)
        if not request.generate:
            max_tokens = 1
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            max_tokens=max_tokens,
            stop_token_ids=tuple(sorted(model.builder.eos_ids)),
        )

    async def save(self, prepared: Prepared, output_ids: list[int], connection) -> None:
        built, request = prepared.built, prepared.request
        key = built.render_key
        if prepared.verify and not await self._verified(prepared):
            key += "!diverged"  # the next continuation of this chain renders in full
        generated = request.generate
        state = ConversationState(
            render_key=key,
            token_ids=(built.prompt_ids + output_ids) if generated else list(built.context_ids),
            after_output=generated and bool(output_ids),
            items=None
            if prepared.items is None
            else prepared.items + tuple(prepared.builder.response["output"]),
        )
        if connection is not None:
            connection.put(prepared.builder.id, state, request)
        if request.store:
            await self.store.put(
                StoredResponse(
                    id=prepared.builder.id,
                    tenant=prepared.tenant.name,
                    created_at=prepared.builder.response["created_at"],
                    response=prepared.builder.snapshot(),
                    input_items=list(prepared.new_items),
                    previous_response_id=request.previous_response_id,
                    render_key=key,
                    prompt_token_ids=state.token_ids if not generated else built.prompt_ids,
                    output_token_ids=output_ids if generated else [],
                )
            )

    async def _verified(self, prepared: Prepared) -> bool:
        """Full render of the same conversation; True when its ids equal the incremental."""
        request = prepared.request
        if prepared.items is None:
            state = await self._previous_state(request.previous_response_id, prepared.tenant, None)
            prepared.items = await self._conversation_items(
                state, request, prepared.tenant
            ) + tuple(request.input_items)
        full = await asyncio.to_thread(
            prepared.model.builder.full,
            prepared.built.render_key,
            request.instructions,
            request.tools,
            prepared.items,
        )
        same = full.prompt_ids == prepared.built.prompt_ids
        self.metrics.verifications.inc()
        if not same:
            self.metrics.divergences.inc()
            logger.info("incremental tokenization diverged from a full render (%s)", request.model)
        return same


class _StreamRunner:
    """The event loop of one response: engine deltas in, Responses events out."""

    def __init__(self, service: ResponsesService, prepared: Prepared, connection):
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
        yield self._finish(detok, parser)
        service._on_cpu("detokenize", self.detok_cpu_s, len(self.output_ids))
        prepared.cpu_s += self.detok_cpu_s
        await service.save(prepared, self.output_ids, self.connection)

    async def _check_failed(self) -> bool:
        verdict = await self.check
        self.check = None
        self.service.metrics.record_safety(verdict, self.first_token_at, self.started)
        return verdict.flagged

    async def _pump(self, engine_request, deltas: asyncio.Queue) -> None:
        try:
            async for delta in self.service.engine.generate(engine_request):
                deltas.put_nowait(delta)
        except Exception as e:  # noqa: BLE001 - handed to the consumer as a failure
            deltas.put_nowait(e)

    async def _next(self, deltas: asyncio.Queue, check):
        """All deltas available now (coalesced), or None when the check finishes first.

        Stream interval: a delta arriving within `stream_interval_s` of the previous batch
        waits out the rest of the interval, gathering what follows. A paced engine (a
        token every few ms or more) is never delayed; a burst becomes one batch, so the
        per-event cost is paid per batch, not per token.
        """
        if deltas.empty() and check is not None:
            getter = asyncio.ensure_future(deltas.get())
            done, _ = await asyncio.wait({getter, check}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                return None
            items = [getter.result()]
        else:
            items = [await deltas.get()]
        interval = self.service.stream_interval_s
        wait = self.last_batch_at + interval - time.perf_counter()
        if wait > 0 and not _finished(items[-1]):
            await asyncio.sleep(wait)
        while not deltas.empty():
            items.append(deltas.get_nowait())
        self.last_batch_at = time.perf_counter()
        return items

    def _on_deltas(self, items, detok, parser) -> tuple[list[dict], bool]:
        events: list[dict] = []
        text_parts: list[str] = []
        for delta in items:
            if isinstance(delta, OnceError):
                raise delta
            if isinstance(delta, BaseException):
                raise OnceError(f"the engine failed: {delta!r}") from delta
            if delta.num_cached_tokens is not None:
                self.cached_tokens = delta.num_cached_tokens
            if self.prepared.request.generate:
                self.output_ids.extend(delta.token_ids)
                text_parts.append(detok.push(delta.token_ids))
            if delta.finished:
                self.finish_reason = delta.finish_reason
                if delta.finish_reason == FINISH_ERROR:
                    error = delta.error or {}
                    raise OnceError(error.get("message", "the engine failed this request"))
                break
        text = "".join(text_parts)
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


def _finished(item) -> bool:
    return isinstance(item, BaseException) or item.finished
