"""Conversation states of stateless clients, found again by what their messages render to.

A stateless client (Chat Completions, Messages, a Responses client resending its whole
input) sends every turn the whole conversation again. Each conversation's state after a
response is kept under a hash chain over its rendered messages:

    h0 = H(tenant, render key)      h(k+1) = H(h(k), message k: role NUL text, or its JSON)

so a request whose messages extend a kept conversation finds the longest kept prefix by
hashing its own messages (no tokenization) and tokenizes only the messages after it.
Two states are kept per response: the prompt's context (its messages, closed), and the
prompt plus the ids the model sampled under the hash of the assistant message a client
sends back when it keeps the reply unchanged. A client that changed the reply's text
(or a tool call's arguments) hashes differently and continues from the first state, so
the reply is tokenized from its text as a full render would.

Bounded: least recently used states go first past `max_states` or `max_tokens` in all.
The ids are kept as the lists they are, handed out without a copy (the continuation
builds its prompt as a new list): converting a compact array back costs ~0.3 ms for a 15k
token conversation, a fifth of the whole stateless path. Tenants never share states: the
tenant seeds the chain.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from once.gateway.prompt.tokens import ConversationState
from once.protocol.responses import canonical_json


def chain_seed(tenant: str, render_key: str) -> bytes:
    return hashlib.blake2b(f"{tenant}\x00{render_key}".encode(), digest_size=16).digest()


def chain(seed: bytes, messages: Sequence[dict]) -> list[bytes]:
    """hashes[k]: the hash of the conversation made of messages[:k + 1]."""
    hashes, current = [], seed
    for message in messages:
        digest = hashlib.blake2b(current, digest_size=16)
        digest.update(_message_bytes(message))
        current = digest.digest()
        hashes.append(current)
    return hashes


def _message_bytes(message: dict) -> bytes:
    # The common message, a role and a string, without a JSON dump of its (long) text;
    # the NUL cannot occur in a role, so the split is unambiguous.
    if len(message) == 2 and isinstance(message.get("content"), str) and "role" in message:
        return f"{message['role']}\x00{message['content']}".encode()
    return canonical_json(message).encode()


@dataclass
class StatelessLookup:
    """A stateless request against the kept states: its messages' hashes and, when a prefix
    is kept, that state, the items after it, and the key it was kept under."""

    hashes: list[bytes]
    state: ConversationState | None = None
    new_items: Sequence[dict] = ()
    used_key: bytes | None = None


def find_prefix(
    states: "PrefixStates", renderer, tenant: str, render_key: str, items: Sequence[dict]
) -> StatelessLookup:
    """Hash the request's messages (no tokenization) and find its longest kept prefix."""
    spans = renderer.message_spans(items)
    hashes = chain(chain_seed(tenant, render_key), [message for message, _ in spans])
    match = states.longest(hashes)
    if match is None:
        return StatelessLookup(hashes, new_items=items)
    last, end = spans[match.num_messages - 1]
    if not match.state.after_output:
        match.state.last_role = last["role"]  # the boundary closes this message's turn
    return StatelessLookup(hashes, match.state, items[end:], hashes[match.num_messages - 1])


@dataclass
class KeptState:
    """A state to keep, under `key`, with the hashes and token offsets of the messages it
    passes through (a request that edits a later message reuses the ids up to there)."""

    key: bytes
    state: ConversationState
    boundaries: list[tuple[bytes, int]] = field(default_factory=list)


def message_boundaries(
    hashes: Sequence[bytes], context_ids: list[int], turn_end_ids: Sequence[int]
) -> list[tuple[bytes, int]]:
    """(hash of messages[:k + 1], the ids' length at its end) for each message but the
    last. A message ends where the template closes a turn (`<|im_end|>\n`); the last
    len(hashes) closings in the ids are the messages' (the head's system turn, when there
    is one, closes before them). Ids that do not close the last message at their very end
    are not cut: a template of another shape, or a closing inside a message's text."""
    n, width = len(turn_end_ids), len(hashes)
    if not n or not width:
        return []
    marker, first = list(turn_end_ids), turn_end_ids[0]
    ends, start = [], 0
    while True:  # list.index scans in C: one step per closing, not per id
        try:
            i = context_ids.index(first, start)
        except ValueError:
            break
        if context_ids[i : i + n] == marker:
            ends.append(i + n)
        start = i + 1
    if len(ends) < width or ends[-1] != len(context_ids):
        return []
    ends = ends[len(ends) - width :]
    return [(hashes[k], ends[k]) for k in range(width - 1)]


def states_after_response(
    renderer,
    hashes: Sequence[bytes],
    render_key: str,
    context_ids: list[int],
    token_ids: list[int],
    output_items: Sequence[dict],
    last_input_item: Sequence[dict],
    turn_end_ids: Sequence[int] = (),
) -> list[KeptState]:
    """A stateless request's two states: its prompt's context (its messages closed, with
    each message's boundary), and the prompt plus the sampled ids (`token_ids`) under the
    hash of the reply a client sends back unchanged (when the prompt did not end inside an
    assistant turn)."""
    if not hashes:
        return []
    boundaries = message_boundaries(hashes, context_ids, turn_end_ids)
    context = ConversationState(render_key, list(context_ids), False)
    states = [KeptState(hashes[-1], context, boundaries)]
    reply = renderer.item_messages(output_items)
    last = renderer.item_messages(last_input_item)
    opens_a_turn = not last or last[-1]["role"] != "assistant"
    if len(token_ids) > len(context_ids) and len(reply) == 1 and opens_a_turn:
        key = chain(hashes[-1], reply)[0]
        states.append(KeptState(key, ConversationState(render_key, list(token_ids), True)))
    return states


@dataclass
class _Kept:
    render_key: str
    token_ids: list[int]
    after_output: bool
    boundary_keys: list[bytes] = field(default_factory=list)


@dataclass
class PrefixMatch:
    state: ConversationState
    num_messages: int  # the kept conversation is the request's first this many messages


class PrefixStates:
    def __init__(self, max_states: int = 512, max_tokens: int = 2_000_000):
        self.max_states = max_states
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._states: OrderedDict[bytes, _Kept] = OrderedDict()
        # A message boundary inside a kept state: its hash -> (the state's key, offset).
        self._boundaries: dict[bytes, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def longest(self, hashes: Sequence[bytes]) -> PrefixMatch | None:
        for k in range(len(hashes) - 1, -1, -1):
            kept = self._states.get(hashes[k])
            if kept is not None:
                self._states.move_to_end(hashes[k])
                state = ConversationState(kept.render_key, kept.token_ids, kept.after_output)
                return PrefixMatch(state, k + 1)
            inside = self._boundaries.get(hashes[k])
            if inside is not None and inside[0] in self._states:
                owner = self._states[inside[0]]
                self._states.move_to_end(inside[0])
                ids = owner.token_ids[: inside[1]]
                return PrefixMatch(ConversationState(owner.render_key, ids, False), k + 1)
        return None

    def put(self, key: bytes, state: ConversationState, boundaries: Sequence = ()) -> None:
        self.discard(key)
        ids = state.token_ids
        if len(ids) > self.max_tokens:
            return
        boundary_keys = []
        for boundary, offset in boundaries:
            self._boundaries[boundary] = (key, offset)
            boundary_keys.append(boundary)
        self._states[key] = _Kept(state.render_key, ids, state.after_output, boundary_keys)
        self.num_tokens += len(ids)
        while len(self._states) > self.max_states or self.num_tokens > self.max_tokens:
            self.discard(next(iter(self._states)))

    def discard(self, key: bytes) -> None:
        """Forget a kept state (or the boundary inside one that `key` names)."""
        inside = self._boundaries.get(key)
        if inside is not None and inside[0] != key:
            del self._boundaries[key]
        kept = self._states.pop(key, None)
        if kept is None:
            return
        self.num_tokens -= len(kept.token_ids)
        for boundary in kept.boundary_keys:
            if self._boundaries.get(boundary, (None,))[0] == key:
                del self._boundaries[boundary]
