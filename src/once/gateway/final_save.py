"""What a finished response leaves to the conversation: the turn the pipeline saves.

The state holds the prompt and the sampled ids (so a continuation appends to them), the
items when the request had them all (stateless ones), and for a stateless request its two
kept prefix states (state/prefix_states.py).
"""

import asyncio
from dataclasses import dataclass

from once.gateway.prepare import Prepared
from once.gateway.prompt.tokens import ConversationState
from once.gateway.state.conversation import SavedTurn
from once.gateway.state.prefix_states import KeptState, states_after_response


@dataclass
class FinalSave:
    """What the last batch leaves to save: the state's ids, the sampled ids, and whether."""

    token_ids: list[int]
    output_ids: list[int]
    save: bool
    verification: asyncio.Task[bool] | None = None


def saved_turn(prepared: Prepared, final: FinalSave, api_object: dict) -> SavedTurn:
    built, request = prepared.built, prepared.request
    items = None
    if prepared.items is not None:
        items = prepared.items + tuple(prepared.output.items)
    state = ConversationState(
        render_key=built.render_key,
        token_ids=final.token_ids,
        after_output=bool(final.output_ids),
        items=items,
    )
    return SavedTurn(
        response_id=prepared.response_id,
        tenant=prepared.tenant.name,
        state=state,
        store=request.store,
        api_object=api_object,
        new_items=list(prepared.new_items),
        previous_response_id=request.previous_response_id,
        prompt_token_ids=final.token_ids[: len(final.token_ids) - len(final.output_ids)],
        output_token_ids=final.output_ids,
        prefix_states=kept_states(prepared, final),
        used_prefix_key=prepared.used_prefix_key,
    )


def kept_states(prepared: Prepared, final: FinalSave) -> list[KeptState]:
    """A stateless request's two states (prefix_states.py): its prompt's context, and
    the prompt plus the sampled ids under the hash of the reply sent back unchanged."""
    built = prepared.built
    return states_after_response(
        prepared.model.renderer,
        prepared.chain_hashes or [],
        built.render_key,
        list(built.context_ids),
        final.token_ids if final.output_ids else list(built.context_ids),
        prepared.output.items,
        prepared.new_items[-1:],
        prepared.model.builder.turn_end_ids,
    )
