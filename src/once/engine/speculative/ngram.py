"""N-gram prompt lookup: find the latest earlier occurrence of the context's last n tokens
(longest n first, from max_n down to min_n) and propose the tokens that followed it."""

from once.engine.request import Request
from once.engine.speculative.drafter import ContextIndexes, Draft


class NgramDrafter:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.lengths = tuple(range(min_n, max_n + 1))
        self.contexts = ContextIndexes(self.lengths)

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[Draft]:
        return [self._propose_one(r, k) for r, k in zip(requests, max_tokens, strict=True)]

    def _propose_one(self, request: Request, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft([])
        index = self.contexts.get(request)
        tokens = index.sequences[0]
        for n in reversed(self.lengths):
            if n > len(tokens):
                continue
            found = index.continuations(tuple(tokens[-n:]))
            if found:
                _, pos = found[-1]  # the most recent occurrence
                return Draft(tokens[pos : pos + max_tokens])
        return Draft([])

    def on_finished(self, request: Request) -> None:
        self.contexts.drop(request)
