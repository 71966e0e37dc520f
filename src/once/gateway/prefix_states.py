"""Conversation states of stateless clients, found again by what their messages render to.

A stateless client (Chat Completions, Messages, a Responses client resending its whole
input) sends every turn the whole conversation again. Each conversation's state after a
response is kept under a hash chain over its rendered messages:

    h0 = H(tenant, render key)      h(k+1) = H(h(k), canonical JSON of message k)

so a request whose messages extend a kept conversation finds the longest kept prefix by
hashing its own messages (no tokenization) and tokenizes only the messages after it.
Two states are kept per response: the prompt's context (its messages, closed), and the
prompt plus the ids the model sampled under the hash of the assistant message a client
sends back when it keeps the reply unchanged. A client that changed the reply's text
(or a tool call's arguments) hashes differently and continues from the first state, so
the reply is tokenized from its text as a full render would.

Bounded: least recently used states go first past `max_states` or `max_tokens` in all.
Token ids are kept as 4-byte arrays. Tenants never share states: the tenant seeds the
chain.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from once.gateway.tokens import ConversationState
from once.protocol.responses import canonical_json


def chain_seed(tenant: str, render_key: str) -> bytes:
    return hashlib.blake2b(f"{tenant}\x00{render_key}".encode(), digest_size=16).digest()


def chain(seed: bytes, messages: Sequence[dict]) -> list[bytes]:
    """hashes[k]: the hash of the conversation made of messages[:k + 1]."""
    hashes, current = [], seed
    for message in messages:
        current = hashlib.blake2b(
            current + canonical_json(message).encode(), digest_size=16
        ).digest()
        hashes.append(current)
    return hashes


@dataclass
class _Kept:
    render_key: str
    token_ids: array
    after_output: bool


@dataclass
class PrefixMatch:
    state: ConversationState
    num_messages: int  # the kept conversation is the request's first this many messages


class PrefixStates:
    def __init__(self, max_states: int = 512, max_tokens: int = 8_000_000):
        self.max_states = max_states
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._states: OrderedDict[bytes, _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def longest(self, hashes: Sequence[bytes]) -> PrefixMatch | None:
        for k in range(len(hashes) - 1, -1, -1):
            kept = self._states.get(hashes[k])
            if kept is not None:
                self._states.move_to_end(hashes[k])
                state = ConversationState(
                    kept.render_key, kept.token_ids.tolist(), kept.after_output
                )
                return PrefixMatch(state, k + 1)
        return None

    def put(self, key: bytes, state: ConversationState) -> None:
        old = self._states.pop(key, None)
        if old is not None:
            self.num_tokens -= len(old.token_ids)
        ids = array("I", state.token_ids)
        if len(ids) > self.max_tokens:
            return
        self._states[key] = _Kept(state.render_key, ids, state.after_output)
        self.num_tokens += len(ids)
        while len(self._states) > self.max_states or self.num_tokens > self.max_tokens:
            _, evicted = self._states.popitem(last=False)
            self.num_tokens -= len(evicted.token_ids)

    def discard(self, key: bytes) -> None:
        kept = self._states.pop(key, None)
        if kept is not None:
            self.num_tokens -= len(kept.token_ids)
