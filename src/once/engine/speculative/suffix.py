"""Suffix drafter (SuffixDecoding-style) over the request's context and its session's history.

Two indexes are searched together: the request's own committed ids, and the outputs of the
same session's earlier requests (keyed by `session_key`, kept per session up to a token
budget, least recently used sessions dropped first). Every index maps each n-gram (n in
geometric lengths up to 32) to where it occurred, i.e. it is a depth-limited suffix tree
flattened into a hash map.

Proposal, per request:
  1. Match: the longest suffix of the context that occurred earlier with a continuation
     (match length m). Its occurrences are the node's subtree in the suffix tree.
  2. Walk: repeatedly take the continuation token most frequent among the surviving
     occurrences (its empirical probability p = count / total), keep only the
     occurrences that continue with it, and multiply the path score by p.
  3. Adapt: stop when the score falls below `min_score`, or at the length budget
     min(max_tokens, ceil(alpha * m)): a long match earns a long draft, a short match a
     short one, so verification is not wasted on weak guesses.
"""

import math
from collections import Counter, OrderedDict

from once.engine.request import Request
from once.engine.speculative.drafter import ContextIndexes, Draft
from once.engine.speculative.index import DEFAULT_LENGTHS, NgramIndex, longest_match

# Occurrences followed during the walk: the most recent, which best predict a copy.
MAX_WALK_OCCURRENCES = 32


class SuffixDrafter:
    def __init__(
        self,
        alpha: float = 2.0,
        min_score: float = 0.1,
        min_match: int = 2,
        session_budget_tokens: int = 65536,
        max_sessions: int = 256,
        lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    ):
        if alpha <= 0 or not 0 <= min_score < 1:
            raise ValueError("need alpha > 0 and 0 <= min_score < 1")
        self.alpha = alpha
        self.min_score = min_score
        self.min_match = min_match
        self.lengths = lengths
        self.session_budget_tokens = session_budget_tokens
        self.max_sessions = max_sessions
        self.contexts = ContextIndexes(lengths)
        self.sessions: OrderedDict[str, NgramIndex] = OrderedDict()

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[Draft]:
        return [self._propose_one(r, k) for r, k in zip(requests, max_tokens, strict=True)]

    def _propose_one(self, request: Request, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft([])
        context_index = self.contexts.get(request)
        context = context_index.sequences[0]
        indexes = [context_index]
        session = self._session(request.session_key, touch=True)
        if session is not None:
            indexes.append(session)
        match_len, found = longest_match(indexes, context, self.lengths)
        if match_len < self.min_match:
            return Draft([])
        budget = min(max_tokens, math.ceil(self.alpha * match_len))
        walkers = [(index, s, p) for index, s, p in found[-MAX_WALK_OCCURRENCES:]]
        draft: list[int] = []
        score = 1.0
        while len(draft) < budget and walkers:
            tokens = (index.token_at(s, p) for index, s, p in walkers)
            # None: an occurrence that reached the end of its sequence.
            counts = Counter(t for t in tokens if t is not None)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            score *= count / sum(counts.values())
            if score < self.min_score:
                break
            draft.append(token)
            walkers = [(i, s, p + 1) for i, s, p in walkers if i.token_at(s, p) == token]
        return Draft(draft)

    def on_finished(self, request: Request) -> None:
        self.contexts.drop(request)
        if request.session_key is None or not request.output_token_ids:
            return
        session = self._session(request.session_key, touch=True, create=True)
        assert session is not None  # a key and create=True
        session.add_sequence(request.output_token_ids)
        if sum(len(s) for s in session.sequences) > self.session_budget_tokens:
            # Rebuild from the newest outputs that fit: simple, and rare.
            kept, total = [], 0
            for seq in reversed(session.sequences):
                total += len(seq)
                if total > self.session_budget_tokens:
                    break
                kept.append(seq)
            rebuilt = NgramIndex(self.lengths)
            for seq in reversed(kept):
                rebuilt.add_sequence(seq)
            self.sessions[request.session_key] = rebuilt

    def _session(self, key: str | None, touch: bool, create: bool = False) -> NgramIndex | None:
        if key is None:
            return None
        index = self.sessions.get(key)
        if index is None and create:
            index = self.sessions[key] = NgramIndex(self.lengths)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        if index is not None and touch:
            self.sessions.move_to_end(key)
        return index
