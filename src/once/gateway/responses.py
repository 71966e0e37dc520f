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
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from once.gateway.auth import Tenant
from once.gateway.events import ResponseBuilder
from once.gateway.model import ModelRuntime
from once.gateway.render import NotIncrementalError
from once.gateway.store import ResponseStore, StoredResponse
from once.gateway.stream import StreamRunner
from once.gateway.tokens import BuiltPrompt, ConversationState, render_key
from once.protocol.engine import (
    EngineClient,
    SamplingParams,
)
from once.protocol.errors import (
    ContextLengthExceededError,
    PreviousResponseNotFoundError,
)
from once.protocol.responses import ResponsesRequest

logger = logging.getLogger(__name__)

# Appended to a conversation's render key when a verification failed on it: no request
# has that key, so the chain's next request renders in full.
DIVERGED = "!diverged"

# Renders above this many characters go to a render thread, so the event loop keeps
# streaming other responses meanwhile: the tokenizer is Rust and releases the GIL, and
# another core takes it. Below, encoding (~0.45 us a character here) costs less than the
# thread hop (~50-100 us). Measured with `once bench gateway` (16 streams): moving the
# 1 KB prompts off the loop cut the gateway's p50 from 38-47 ms to 21-31 ms.
INLINE_RENDER_CHARS = 256


@functools.cache
def render_pool():
    """The process's render threads: one per core beyond the event loop's, at most 4.

    A pool of its own, not the default executor's 6+ threads: more renders at once than
    spare cores would only take the CPU from the event loop (and lengthen its tail).
    """
    from concurrent.futures import ThreadPoolExecutor

    num_threads = min(4, max(1, len(os.sched_getaffinity(0)) - 1))
    return ThreadPoolExecutor(num_threads, thread_name_prefix="once-render")


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
    """A WebSocket connection's last responses (works with store=false): the conversation
    state a continuation builds on, and the request fields it inherits."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self.states: dict[str, ConversationState] = {}
        self.fields: dict[str, dict] = {}

    def put(self, response_id: str, state: ConversationState) -> None:
        self.states[response_id] = state
        _keep_newest(self.states, self.capacity)

    def remember_fields(self, response_id: str, fields: dict) -> None:
        self.fields[response_id] = fields
        _keep_newest(self.fields, self.capacity)

    def get(self, response_id: str) -> ConversationState | None:
        return self.states.get(response_id)


def _keep_newest(entries: dict, capacity: int) -> None:
    while len(entries) > capacity:
        del entries[next(iter(entries))]


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
        self._background: set[asyncio.Task] = set()  # engine streams winding down

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
            return cached
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
            loop = asyncio.get_running_loop()
            built = await loop.run_in_executor(render_pool(), functools.partial(fn, *args))
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
        async for batch in StreamRunner(self, prepared, connection).run():
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

    async def drain_verifications(self) -> None:
        """Wait for the background verifications (tests, and a clean shutdown)."""
        while self._verifications:
            await asyncio.gather(*list(self._verifications), return_exceptions=True)

    def keep_until_done(self, task: asyncio.Task) -> None:
        """Hold a reference to a task left to finish on its own (the loop keeps weak ones)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def start_verification(self, prepared: Prepared) -> asyncio.Task | None:
        """The sampled check of an incremental prompt, run beside generation."""
        if not prepared.verify:
            return None
        task = asyncio.create_task(self._verified(prepared))
        self._verifications.add(task)
        task.add_done_callback(self._verifications.discard)
        return task

    async def save(
        self, prepared: Prepared, output_ids: list[int], connection, verification=None
    ) -> None:
        """Keep the conversation's state; a failed verification marks it for a full render.

        The verification runs in the background: when it is still running, the state is
        saved now and marked when it fails, so a client never waits for the check.
        """
        built, request = prepared.built, prepared.request
        key = built.render_key
        if verification is not None and verification.done() and not verification.result():
            key += DIVERGED
            verification = None
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
            connection.put(prepared.builder.id, state)
        record = None
        if request.store:
            record = StoredResponse(
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
            await self.store.put(record)
        if verification is not None and not verification.done():
            marker = asyncio.create_task(self._mark_if_diverged(verification, state, record))
            self._verifications.add(marker)
            marker.add_done_callback(self._verifications.discard)

    async def _mark_if_diverged(self, verification, state, record) -> None:
        if await verification:
            return
        state.render_key += DIVERGED  # the connection's copy: the object it holds
        if record is not None:
            record.render_key += DIVERGED
            await self.store.put(record)

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
