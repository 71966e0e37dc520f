"""One response's whole life in the gateway, for every API and transport.

    admit    schema -> semantics -> API key -> request rate limit      (400/401/404/429)
    prepare  previous state -> render + tokenize (only the new items of a continuation)
             -> context length -> token rate limit -> the hosted tools' work the request
             brings (a program's outputs, an MCP approval or listing; hosted/base.py)
    stream   dispatch to the EngineClient with the input check beside it -> detokenize,
             parse tool calls -> neutral output events -> the API's encoder -> framing;
             the conversation is saved before the final event goes out, since a client
             continues the moment it sees it; a store that fails does not fail the
             response: the failure is logged, counted (once_gateway_store_failures) and
             written into the final event (the encoder's `store_failed`)

Front ends (HTTP JSON, SSE, WebSocket) only decode what arrived and write what `stream`
yields. The in-flight gauge, the request counter, the CPU meter and the time the gateway
adds are recorded here, once. A warm-up (`generate: false`) is its own short path: a
one-token prefill, no output, and the context saved for the continuation.

The time the gateway adds to a response is the wall time of its own sections: admission,
preparation, the work per event batch (detokenize, parse, encode, frame), the save, and
the writes (from handing a batch to the front end until it asks for the next). Waiting for
the engine, the input check and the stream interval are not counted: it is a sum of
durations, so it cannot go below zero.

A streamed response that waits longer than `keep_alive_s` for its next batch (a long
prefill, a hosted tool) gets the encoder's keep-alive meanwhile (keep_alive.py).
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from once.gateway.admission.auth import KeyRing, Tenant
from once.gateway.admission.capacity import CpuCostMeter
from once.gateway.admission.ratelimit import RateLimiter
from once.gateway.aliases import ModelAliases
from once.gateway.config import GatewayConfig
from once.gateway.final_save import FinalSave, saved_turn
from once.gateway.front.keep_alive import KEEP_ALIVE, with_keep_alives
from once.gateway.generation import EventBatch, Generation
from once.gateway.hosted.base import MAX_HOSTED_CALLS, HostedOutcome, HostedTools, HostedTurn
from once.gateway.metrics import GatewayMetrics
from once.gateway.model import ModelRuntime
from once.gateway.output import COMPLETED, OutputEvent, Usage
from once.gateway.pause_hints import pause_hint
from once.gateway.prepare import Prepared, PromptPreparer
from once.gateway.prompt.constraints import output_constraint
from once.gateway.prompt.tokens import BuiltPrompt
from once.gateway.prompt.tool_items import hosted_tool_names
from once.gateway.state.conversation import ConnectionCache, Conversations
from once.gateway.state.prefix_states import PrefixStates
from once.gateway.state.store import ResponseStore
from once.gateway.validation import check_semantics
from once.gateway.warm_up import warm_up_events
from once.protocol.engine import EngineClient, SamplingParams
from once.protocol.errors import OnceError
from once.protocol.responses import ResponsesRequest

logger = logging.getLogger(__name__)


class EventEncoder(Protocol):
    """An API's side of a response: neutral output events in, its wire events out."""

    def encode(self, events: EventBatch) -> list[Any]: ...

    def api_object(self) -> dict: ...  # the finished response as the API returns it

    def store_failed(self, wire: list[Any], error: dict) -> None:
        """The response was not stored: say so in `wire` (the final batch, encoded but not
        framed yet) and in `api_object`."""

    def keep_alive(self) -> list[Any]: ...  # wire events that say "still working" (keep_alive.py)


Frame = Callable[[list[Any]], object]  # a batch of wire events -> what the transport writes


@dataclass
class Admission:
    body: dict  # as decoded, after what a WebSocket continuation inherits
    request: ResponsesRequest
    tenant: Tenant
    model: ModelRuntime
    transport: str
    admit_s: float
    api: str = "responses"  # responses | chat | messages


@dataclass(frozen=True)
class GatewayParts:
    """The collaborators of a gateway, built once by create_gateway (app.py)."""

    engine: EngineClient
    models: dict[str, ModelRuntime]
    store: ResponseStore
    metrics: GatewayMetrics
    meter: CpuCostMeter
    keyring: KeyRing
    limiter: RateLimiter
    aliases: ModelAliases
    prefix_states: PrefixStates
    hosted: HostedTools


class ResponsePipeline:
    def __init__(self, config: GatewayConfig, parts: "GatewayParts"):
        self.config = config
        self.parts = parts
        # The parts this class calls itself (create_gateway builds them from the config).
        self.engine = parts.engine
        self.models = parts.models
        self.aliases = parts.aliases
        self.hosted = parts.hosted
        self.store = parts.store
        self.metrics = parts.metrics
        self.meter = parts.meter
        self.keyring = parts.keyring
        self.limiter = parts.limiter
        self.stream_interval_s = config.stream_interval_s
        self.keep_alive_s = config.keep_alive_s
        self.default_max_output_tokens = config.default_max_output_tokens
        self.conversations = Conversations(parts.store, parts.prefix_states)
        self.preparer = PromptPreparer(
            self.conversations, parts.metrics, parts.meter.record, verify_every=config.verify_every
        )
        self.num_inflight = 0
        self._verifications: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()  # engine streams winding down

    # -- before the first event ------------------------------------------------------------

    async def admit(
        self,
        body: object,
        authorization: str | None,
        *,
        transport: str,
        received_at: float,
        parse: Callable[[object], ResponsesRequest],
        api: str = "responses",
        inherit: Callable[[dict], Awaitable[dict]] | None = None,
    ) -> Admission:
        """`parse` is the API's adapter (its body -> the pipeline's request). Semantic
        checks come before auth, as OpenAI's API orders them."""
        try:
            if inherit is not None and isinstance(body, dict):
                body = await inherit(body)
            request = parse(body)
            if not request.ignored_tools:
                hosted = hosted_tool_names(request.tools, self.hosted.tool_types)
                request = replace(request, ignored_tools=tuple(hosted)) if hosted else request
            functions = self.hosted.prompt_functions(request)
            request = replace(request, hosted_functions=functions) if functions else request
            model = check_semantics(request, self.models, self.aliases)
            tenant = self.keyring.authenticate(authorization)
            await self.limiter.hit_request(tenant)
        except OnceError:
            self.metrics.requests.labels(transport, "error").inc()
            raise
        admit_s = time.perf_counter() - received_at
        assert isinstance(body, dict)  # parse_request refuses anything else
        return Admission(body, request, tenant, model, transport, admit_s, api)

    async def prepare(
        self, admission: Admission, connection: ConnectionCache | None = None
    ) -> Prepared:
        t0 = time.perf_counter()
        try:
            prepared = await self.preparer.prepare(
                admission.request, admission.tenant, admission.model, connection, int(time.time())
            )
            await self.limiter.hit_tokens(admission.tenant, len(prepared.built.prompt_ids))
            prepared.opened = await self._open_hosted(prepared)
        except OnceError:
            self.metrics.requests.labels(admission.transport, "error").inc()
            raise
        prepared.added.admit_s = admission.admit_s
        prepared.added.prepare_s = time.perf_counter() - t0
        mode = "websocket" if admission.transport == "websocket" else "json"
        if mode == "json" and admission.request.stream:
            mode = "sse"
        self.metrics.api_requests.labels(admission.api, mode).inc()
        return prepared

    async def _open_hosted(self, prepared: Prepared) -> HostedOutcome | None:
        """The hosted tools' work the request brings before generation (hosted/base.py): here,
        before the first event, so a request that cannot go on is refused like any other."""
        request = prepared.request
        if not request.generate or not self.hosted.opens(request):
            return None
        items = await self.preparer.load_items(prepared)
        return await self.hosted.open(HostedTurn(request, items))

    async def count_prompt_tokens(self, admission: Admission) -> int:
        return await self.preparer.count_prompt_tokens(
            admission.request, admission.tenant, admission.model
        )

    def load_report_header(self) -> str:
        return self.meter.load_report_header(self.num_inflight)

    # -- the stream ------------------------------------------------------------------------

    async def stream(
        self, prepared: Prepared, encoder: EventEncoder, transport: str, frame: Frame
    ) -> AsyncGenerator[Any, None]:
        """The response's framed batches; its accounting, whatever way it ends."""
        added = prepared.added
        outcome = "disconnected"  # a stream closed early: the client left
        self.num_inflight += 1
        self.metrics.inflight.inc()
        batches: AsyncIterator[Any] = self._batches(prepared)
        if self.keep_alive_s > 0 and (transport == "websocket" or prepared.request.stream):
            batches = with_keep_alives(batches, self.keep_alive_s)
        try:
            async for item in batches:
                if item is KEEP_ALIVE:
                    yield frame(encoder.keep_alive())
                    continue
                events, final = item
                t0 = time.perf_counter()
                wire = encoder.encode(events)
                if final is not None:
                    # Saved before the final event goes out: a client continues at once.
                    store_error = await self._save(prepared, final, encoder)
                    if store_error is not None:
                        self._report_store_failure(prepared, store_error, encoder, wire)
                    self._hint_pause(prepared)
                framed = frame(wire)
                t1 = time.perf_counter()
                prepared.cpu_s += t1 - t0
                added.events_s += t1 - t0
                yield framed
                added.writes_s += time.perf_counter() - t1
                finished = prepared.output.finished
                if final is not None and finished is not None:
                    outcome = f"response.{finished.status}"  # the last event was written
        finally:
            self.num_inflight -= 1
            self.metrics.inflight.dec()
            self.metrics.requests.labels(transport, outcome).inc()
            self.meter.record("request", prepared.cpu_s, len(prepared.built.prompt_ids))
            self.metrics.record_added_time(added)

    async def _batches(
        self, prepared: Prepared
    ) -> AsyncIterator[tuple[EventBatch, FinalSave | None]]:
        """Neutral event batches, the last one paired with what to save (or not)."""
        if not prepared.request.generate:
            sampling = replace(self.sampling(prepared), max_tokens=1)
            async for batch in warm_up_events(self.engine, prepared, sampling, self.metrics):
                finished = prepared.output.finished
                if finished is None:
                    yield batch, None
                else:
                    context = list(prepared.built.context_ids)
                    yield batch, FinalSave(context, [], finished.status == COMPLETED)
            return
        verification = self._start_verification(prepared)
        output = prepared.output
        built, usage = prepared.built, Usage(0, 0, 0)
        if prepared.opened is not None:
            # What the request resumed or brought (hosted/base.py) comes first.
            batch = output.started() + output.hosted_items(prepared.opened.items)
            if prepared.opened.suspend:
                final = FinalSave(list(built.context_ids), [], True, verification)
                yield batch + self._suspended(prepared, usage), final
                return
            yield batch, None
            built = await self.preparer.next_step(prepared, built, output.items)
        runs_here = self.hosted.runs_here(prepared.request)
        for num_hosted in range(MAX_HOSTED_CALLS + 1):
            generation = Generation(
                self.engine,
                prepared,
                self.sampling(prepared, built),
                self.metrics,
                stream_interval_s=self.stream_interval_s,
                keep_until_done=self._keep_until_done,
                built=built,
                runs_here=runs_here if num_hosted < MAX_HOSTED_CALLS else lambda item: False,
                usage_before=usage,
            )
            step_start = len(output.items)
            async for batch in generation.events():
                if output.finished is None:
                    yield batch, None
                    continue
                self._record_detokenize(prepared, generation)
                ids = generation.output_ids
                # Ids sampled past a stop string are not the text the client saw: no state.
                save = generation.completed_normally and generation.stops.matched is None
                yield batch, FinalSave(built.prompt_ids + ids, ids, save, verification)
            if generation.pending_call is None:
                return
            # A hosted call: run it, show its items, and go on from a prompt holding them;
            # or end here when the client must act first (the state: the step's context
            # and its items, rendered, as a continuation finds a closed turn).
            self._record_detokenize(prepared, generation)
            turn = HostedTurn(
                prepared.request, await self.preparer.load_items(prepared), tuple(output.items)
            )
            outcome = await self.hosted.run(generation.pending_call, turn)
            usage = generation.usage()
            batch = output.hosted_items(outcome.items)
            if not outcome.suspend:
                yield batch, None  # shown before the next step's prompt is built
            built = await self.preparer.next_step(prepared, built, output.items[step_start:])
            if outcome.suspend:
                final = FinalSave(list(built.context_ids), [], True, verification)
                yield batch + self._suspended(prepared, usage), final
                return

    def _suspended(self, prepared: Prepared, usage: Usage) -> list[OutputEvent]:
        """The response ends where a hosted tool waits for the client (hosted/base.py)."""
        self.metrics.record_usage(usage)
        return prepared.output.finish(COMPLETED, usage)

    def _record_detokenize(self, prepared: Prepared, generation: Generation) -> None:
        self.meter.record("detokenize", generation.detok_cpu_s, len(generation.output_ids))
        prepared.cpu_s += generation.detok_cpu_s
        prepared.added.events_s += generation.detok_cpu_s

    def sampling(self, prepared: Prepared, built: BuiltPrompt | None = None) -> SamplingParams:
        request, model = prepared.request, prepared.model
        room = model.max_model_len - len((built or prepared.built).prompt_ids)
        asked = request.max_output_tokens or self.default_max_output_tokens
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            max_tokens=min(asked or room, room),
            stop_token_ids=tuple(sorted(model.builder.eos_ids)),
            seed=request.seed,
            logprobs=request.logprobs,
            constraint=output_constraint(request, prepared.items or prepared.new_items),
        )

    def _report_store_failure(
        self, prepared: Prepared, error: OnceError, encoder: EventEncoder, wire: list[Any]
    ) -> None:
        self.metrics.store_failures.inc()
        logger.warning("response %s was not stored: %s", prepared.response_id, error.message)
        encoder.store_failed(wire, {"code": error.code, "message": error.message})

    async def _save(
        self, prepared: Prepared, final: FinalSave, encoder: EventEncoder
    ) -> OnceError | None:
        """Keep the conversation; the store's error when the response could not be stored."""
        if not final.save:
            return None
        api_object = encoder.api_object() if prepared.request.store else {}
        turn = saved_turn(prepared, final, api_object)
        return await self.conversations.save(turn, prepared.connection, final.verification)

    def _start_verification(self, prepared: Prepared) -> asyncio.Task[bool] | None:
        task = self.preparer.start_verification(prepared)
        if task is not None:
            self._verifications.add(task)
            task.add_done_callback(self._verifications.discard)
        return task

    def _hint_pause(self, prepared: Prepared) -> None:
        # Sent as the response completes: the engine hears before the client continues.
        finished = prepared.output.finished
        if finished is not None and finished.status == COMPLETED:
            hint = pause_hint(prepared.request, prepared.output.items, self.engine)
            if hint is not None:
                self._keep_until_done(asyncio.create_task(hint))

    def _keep_until_done(self, task: asyncio.Task) -> None:
        """Hold a reference to a task left to finish on its own (the loop keeps weak ones)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_verifications(self) -> None:
        """Wait for the background verifications (tests, and a clean shutdown)."""
        while self._verifications:
            await asyncio.gather(*list(self._verifications), return_exceptions=True)
        await self.conversations.drain()

    async def close(self) -> None:
        await self.store.close()
