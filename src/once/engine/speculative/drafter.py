"""The drafter contract and the per-request context index every text drafter shares.

A drafter proposes up to `max_tokens` next ids for each decoding request. It reads only
`request.all_token_ids` (prompt + committed outputs): forced ids ahead of the current
position are never visible to it, so a replay drafts exactly as a live request would.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from once.engine.request import Request
from once.engine.speculative.index import DEFAULT_LENGTHS, NgramIndex


@dataclass
class Draft:
    token_ids: list[int]
    # (len(token_ids), vocab) probabilities the drafter sampled from; None means the draft
    # is deterministic (a point mass on each id), as for n-gram and suffix drafts.
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[Draft]: ...

    def on_finished(self, request: Request) -> None: ...


class ContextIndexes:
    """One NgramIndex per live request over its committed ids, extended incrementally."""

    def __init__(self, lengths: tuple[int, ...] = DEFAULT_LENGTHS):
        self.lengths = lengths
        self.by_request: dict[str, NgramIndex] = {}

    def get(self, request: Request) -> NgramIndex:
        index = self.by_request.get(request.request_id)
        if index is None:
            index = NgramIndex(self.lengths)
            index.add_sequence()
            self.by_request[request.request_id] = index
        seq = index.sequences[0]
        committed = request.all_token_ids
        if len(seq) < len(committed):
            index.extend(0, committed[len(seq) :])
        return index

    def drop(self, request: Request) -> None:
        self.by_request.pop(request.request_id, None)
