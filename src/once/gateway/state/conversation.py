"""Where a conversation stands between responses, and where it is kept.

A response continues a conversation through `previous_response_id`, looked up first in the
caller's WebSocket connection (which keeps its last responses even with `store: false`)
and then in the store (scoped to the tenant); a stateless request, which resends the
whole conversation, finds its longest kept prefix by the hash of its messages
(prefix_states.py). What is kept is a `ConversationState`: the
token ids the engine saw plus the ids the model sampled, so a continuation tokenizes only
its new items, and, when known, every item so far.

A failed verification appends `DIVERGED` to the state's render key: no request has that
key, so the chain's next request renders in full. Verification runs in the background:
when it is still running at save time the state is saved at once and marked if it fails,
so a client never waits for the check.

A store that fails (a full or read-only disk, Redis down) does not fail the response:
`save` keeps the state in the connection and the kept prefixes as usual and returns the
error, for the pipeline to report; the store's own put is one statement, so nothing is
half-written.
"""

import asyncio
import logging
from dataclasses import dataclass, field

from once.gateway.admission.auth import Tenant
from once.gateway.prompt.tokens import ConversationState
from once.gateway.state.prefix_states import KeptState, PrefixStates
from once.gateway.state.store import ResponseStore, ResponseStoreUnavailableError, StoredResponse
from once.protocol.errors import PreviousResponseNotFoundError

logger = logging.getLogger(__name__)

DIVERGED = "!diverged"


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


@dataclass
class SavedTurn:
    """What a finished response leaves behind, before it is kept."""

    response_id: str
    tenant: str
    state: ConversationState
    store: bool
    api_object: dict  # the response as the API returns it (GET /v1/responses/{id})
    new_items: list[dict]
    previous_response_id: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # A stateless request's states, under the hashes a resend of them will have, and the
    # kept state its prompt was built on (dropped too if the prompt diverged).
    prefix_states: list[KeptState] = field(default_factory=list)
    used_prefix_key: bytes | None = None


class Conversations:
    """Conversation states in connections and in the response store."""

    def __init__(self, store: ResponseStore, prefix_states: PrefixStates | None = None):
        self.store = store
        self.prefix_states = PrefixStates() if prefix_states is None else prefix_states
        self._markers: set[asyncio.Task] = set()

    async def previous_state(
        self, response_id: str, tenant: Tenant, connection: ConnectionCache | None
    ) -> ConversationState:
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

    async def items_before(
        self, state: ConversationState, previous_response_id: str, tenant: Tenant
    ) -> tuple[dict, ...]:
        """Every item before this request: the chain of stored responses, walked back."""
        if state.items is not None:
            return state.items
        chain: list[StoredResponse] = []
        response_id: str | None = previous_response_id
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

    async def save(
        self,
        turn: SavedTurn,
        connection: ConnectionCache | None,
        verification: asyncio.Task[bool] | None,
    ) -> ResponseStoreUnavailableError | None:
        """Keep the turn; the store's error when it could not be stored."""
        state = turn.state
        if verification is not None and verification.done() and not verification.result():
            state.render_key += DIVERGED
            verification = None
            turn.prefix_states = []  # a diverged prompt is no state to build on
            if turn.used_prefix_key is not None:
                self.prefix_states.discard(turn.used_prefix_key)
        if connection is not None:
            connection.put(turn.response_id, state)
        for kept in turn.prefix_states:
            self.prefix_states.put(kept.key, kept.state, kept.boundaries)
        record, store_error = None, None
        if turn.store:
            record = StoredResponse(
                id=turn.response_id,
                tenant=turn.tenant,
                created_at=turn.api_object["created_at"],
                response=turn.api_object,
                input_items=turn.new_items,
                previous_response_id=turn.previous_response_id,
                render_key=state.render_key,
                prompt_token_ids=turn.prompt_token_ids,
                output_token_ids=turn.output_token_ids,
            )
            try:
                await self.store.put(record)
            except ResponseStoreUnavailableError as error:
                record, store_error = None, error
        if verification is not None and not verification.done():
            keys = [kept.key for kept in turn.prefix_states]
            if turn.used_prefix_key is not None:
                keys.append(turn.used_prefix_key)
            marker = asyncio.create_task(self._mark_if_diverged(verification, state, record, keys))
            self._markers.add(marker)
            marker.add_done_callback(self._markers.discard)
        return store_error

    async def _mark_if_diverged(
        self,
        verification: asyncio.Task[bool],
        state: ConversationState,
        record: StoredResponse | None,
        prefix_keys: list[bytes],
    ) -> None:
        if await verification:
            return
        state.render_key += DIVERGED  # the connection's copy: the object it holds
        for key in prefix_keys:
            self.prefix_states.discard(key)
        if record is not None:
            record.render_key += DIVERGED
            try:
                await self.store.put(record)
            except ResponseStoreUnavailableError as error:
                # The stored record keeps its unmarked key; the connection's state and
                # the kept prefixes, marked above, are what continuations mostly use.
                logger.warning("could not mark %s as diverged: %s", record.id, error)

    async def drain(self) -> None:
        while self._markers:
            await asyncio.gather(*list(self._markers), return_exceptions=True)
