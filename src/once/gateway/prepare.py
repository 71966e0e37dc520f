"""Prepare a response: its prompt token ids, from a full render or only the new items.

A request that continues a known conversation with the same render key (model,
instructions, tools) tokenizes only its new items on top of the ids so far (tokens.py);
anything else renders the whole conversation. Every `verify_every`-th incremental prompt is
checked against a full render of the same conversation in the background.

Renders above `INLINE_RENDER_CHARS` characters go to a render thread, so the event loop
keeps streaming other responses meanwhile: the tokenizer is Rust and releases the GIL, and
another core takes it. Below, encoding (~0.45 us a character here) costs less than the
thread hop (~50-100 us).
"""

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from once.cpus import usable_cores
from once.gateway.admission.auth import Tenant
from once.gateway.hosted.base import HostedOutcome
from once.gateway.metrics import AddedTime, GatewayMetrics
from once.gateway.model import ModelRuntime
from once.gateway.output import OutputBuilder, new_id
from once.gateway.prompt.render import NotIncrementalError
from once.gateway.prompt.tokens import INCREMENTAL, BuiltPrompt, ConversationState, render_key
from once.gateway.state.conversation import ConnectionCache, Conversations
from once.gateway.state.prefix_states import find_prefix
from once.protocol.errors import ContextLengthExceededError
from once.protocol.responses import ResponsesRequest

logger = logging.getLogger(__name__)

INLINE_RENDER_CHARS = 256
NOTHING_RENDERED = "!empty"


@functools.cache
def render_pool() -> ThreadPoolExecutor:
    """The process's render threads: one per core beyond the event loop's, at most 4.

    A pool of its own, not the default executor's 6+ threads: more renders at once than
    spare cores would only take the CPU from the event loop (and lengthen its tail).
    """
    num_threads = min(4, max(1, usable_cores() - 1))
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
    connection: ConnectionCache | None = None
    # Stateless requests: the hash chain of their messages (prefix_states.py).
    chain_hashes: list[bytes] | None = None
    used_prefix_key: bytes | None = None  # the kept state an incremental prompt came from
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = 0
    # This response's CPU in the gateway's synchronous sections (thread time): render,
    # tokenize, detokenize, events, framing.
    cpu_s: float = 0.0
    added: AddedTime = field(default_factory=AddedTime)
    # What hosted tools did with the request before generation (hosted/base.py), if anything.
    opened: HostedOutcome | None = None
    output: OutputBuilder = field(init=False)

    def __post_init__(self):
        self.output = OutputBuilder(self.response_id, self.created_at)


StageRecorder = Callable[[str, float, int], None]  # (stage, cpu_s, num_tokens)


class PromptPreparer:
    def __init__(
        self,
        conversations: Conversations,
        metrics: GatewayMetrics,
        record_stage: StageRecorder,
        *,
        verify_every: int,
    ):
        self.conversations = conversations
        self.metrics = metrics
        self.record_stage = record_stage
        self.verify_every = max(0, verify_every)
        self._num_incremental = 0

    async def prepare(
        self,
        request: ResponsesRequest,
        tenant: Tenant,
        model: ModelRuntime,
        connection: ConnectionCache | None,
        created_at: int,
    ) -> Prepared:
        key = render_key(model.name, request.instructions, request.prompt_tools)
        state, items, new_items = None, None, request.input_items
        chain_hashes: list[bytes] | None = None
        used_prefix_key: bytes | None = None
        if request.previous_response_id:
            state = await self.conversations.previous_state(
                request.previous_response_id, tenant, connection
            )
        else:
            # Stateless: the request holds the whole conversation; a kept state of its
            # longest known prefix saves tokenizing that prefix again.
            items = tuple(request.input_items)
            # Before the messages are hashed: hashing a 20 MB prompt costs more than all
            # the rest of refusing it.
            _check_bound(model, None, items, request)
            lookup = find_prefix(
                self.conversations.prefix_states, model.renderer, tenant.name, key, items
            )
            chain_hashes, state, used_prefix_key = lookup.hashes, lookup.state, lookup.used_key
            new_items = tuple(lookup.new_items)
        if state is not None:  # the ids so far and the new items' characters
            _check_bound(model, state, new_items, request)
        built = None
        if state is not None and state.render_key == key:
            try:
                built = await self._run_cpu(
                    _num_chars(new_items),
                    model.builder.continuation,
                    state,
                    request.prompt_tools,
                    new_items,
                )
            except NotIncrementalError:
                self.metrics.fallbacks.inc()
        if built is None:
            if items is None:
                items = await self._all_items(state, request, tenant)
        if built is None and not items:
            # A warm-up of no items (Codex prewarms so): nothing to render or prefill. The
            # key no request has makes its continuation render in full.
            built = BuiltPrompt([], [], "full", 0, 0, key + NOTHING_RENDERED)
        if built is None:
            built = await self._run_cpu(
                _num_chars(items),
                model.builder.full,
                key,
                request.instructions,
                request.prompt_tools,
                items,
            )
        elif state is not None and state.items is not None:
            items = state.items + tuple(request.input_items)
        _check_length(built, model)
        self.metrics.record_build(built)
        verify = False
        if built.mode == "incremental" and self.verify_every:
            self._num_incremental += 1
            verify = self._num_incremental % self.verify_every == 0
        return Prepared(
            request,
            tenant,
            model,
            built,
            items,
            request.input_items,
            verify,
            connection=connection,
            created_at=created_at,
            cpu_s=built.render_cpu_s + built.tokenize_cpu_s,
            chain_hashes=chain_hashes,
            used_prefix_key=used_prefix_key if built.mode == INCREMENTAL else None,
        )

    async def next_step(
        self, prepared: Prepared, built: BuiltPrompt, step_items: Sequence[dict]
    ) -> BuiltPrompt:
        """The prompt of a response's next step after a hosted call (hosted/base.py): the last
        step's context (its prompt without the generation prompt) and the step's items."""
        request, model = prepared.request, prepared.model
        # The step's context ends with the request's last turn, which the model answered.
        last = model.renderer.item_messages((prepared.items or prepared.new_items)[-1:])
        context = ConversationState(built.render_key, list(built.context_ids), False)
        context.last_role = last[-1]["role"] if last else None
        try:
            step = await self._run_cpu(
                _num_chars(step_items), model.builder.continuation, context, request.prompt_tools,
                step_items,
            )  # fmt: skip
        except NotIncrementalError:
            items = (prepared.items or prepared.new_items) + tuple(prepared.output.items)
            step = await self._run_cpu(
                _num_chars(items), model.builder.full, built.render_key, request.instructions,
                request.prompt_tools, items,
            )  # fmt: skip
        _check_length(step, model)
        self.metrics.record_build(step)
        return step

    async def load_items(self, prepared: Prepared) -> tuple[dict, ...]:
        """Every item of the conversation, this request's last: read back from the chain of
        stored responses when the state did not hold them (kept in `prepared.items`)."""
        if prepared.items is None:
            request = prepared.request
            assert request.previous_response_id is not None  # else the request holds them all
            state = await self.conversations.previous_state(
                request.previous_response_id, prepared.tenant, prepared.connection
            )
            prepared.items = await self._all_items(state, request, prepared.tenant)
        return prepared.items

    async def count_prompt_tokens(
        self, request: ResponsesRequest, tenant: Tenant, model: ModelRuntime
    ) -> int:
        """The prompt's length in tokens, as a full render gives it (no engine, no state
        kept): what the APIs' token counters answer. A prompt its characters prove longer
        than the context is a `context_length_exceeded` error instead."""
        state = None
        if request.previous_response_id:
            state = await self.conversations.previous_state(
                request.previous_response_id, tenant, None
            )
        items = await self._all_items(state, request, tenant)
        # A prompt that can never be served is refused, not counted: counting it would
        # tokenize all of it.
        _check_bound(model, None, items, request)
        key = render_key(model.name, request.instructions, request.prompt_tools)
        built = await self._run_cpu(
            _num_chars(items),
            model.builder.full,
            key,
            request.instructions,
            request.prompt_tools,
            items,
        )
        return len(built.prompt_ids)

    async def _all_items(
        self, state: ConversationState | None, request: ResponsesRequest, tenant: Tenant
    ) -> tuple[dict, ...]:
        if state is None or request.previous_response_id is None:
            return tuple(request.input_items)
        before = await self.conversations.items_before(state, request.previous_response_id, tenant)
        return before + tuple(request.input_items)

    async def _run_cpu(self, size: int, fn: Callable[..., BuiltPrompt], *args) -> BuiltPrompt:
        """Render and tokenize inline when small, in a worker thread when large."""
        if size > INLINE_RENDER_CHARS:
            loop = asyncio.get_running_loop()
            built = await loop.run_in_executor(render_pool(), functools.partial(fn, *args))
        else:
            built = fn(*args)
        self.record_stage("render", built.render_cpu_s, built.num_tokenized)
        self.record_stage("tokenize", built.tokenize_cpu_s, built.num_tokenized)
        return built

    def start_verification(self, prepared: Prepared) -> asyncio.Task[bool] | None:
        """The sampled check of an incremental prompt, run beside generation."""
        if not prepared.verify:
            return None
        return asyncio.create_task(self._verified(prepared))

    async def _verified(self, prepared: Prepared) -> bool:
        """Full render of the same conversation; True when its ids equal the incremental."""
        request = prepared.request
        if prepared.items is None:
            assert request.previous_response_id is not None  # an incremental prompt has one
            state = await self.conversations.previous_state(
                request.previous_response_id, prepared.tenant, None
            )
            prepared.items = await self._all_items(state, request, prepared.tenant)
        full = await asyncio.to_thread(
            prepared.model.builder.full,
            prepared.built.render_key,
            request.instructions,
            request.prompt_tools,
            prepared.items,
        )
        same = full.prompt_ids == prepared.built.prompt_ids
        self.metrics.verifications.inc()
        if not same:
            self.metrics.divergences.inc()
            logger.info("incremental tokenization diverged from a full render (%s)", request.model)
        return same


def _num_chars(items) -> int:
    return sum(len(str(item)) for item in items)


def _check_bound(
    model: ModelRuntime,
    state: ConversationState | None,
    items: Sequence[dict],
    request: ResponsesRequest,
) -> None:
    """Refuse, before any rendering or tokenizing, a prompt its characters alone prove too
    long: no token covers more than `max_token_chars` of them (a 20 MB body costs ms)."""
    num_chars = len(request.instructions or "") + sum(
        len(message["content"])
        for message in model.renderer.item_messages(items)
        if isinstance(message.get("content"), str)
    )
    at_least = num_chars // max(1, model.max_token_chars)
    if state is not None:
        at_least += len(state.token_ids)
    if at_least >= model.max_model_len:
        raise ContextLengthExceededError(
            f"the prompt is at least {at_least} tokens; this model's context is "
            f"{model.max_model_len}",
            param="input",
        )


def _check_length(built: BuiltPrompt, model: ModelRuntime) -> None:
    if model.max_model_len - len(built.prompt_ids) < 1:
        raise ContextLengthExceededError(
            f"the prompt is {len(built.prompt_ids)} tokens; this model's context is "
            f"{model.max_model_len}",
            param="input",
        )
