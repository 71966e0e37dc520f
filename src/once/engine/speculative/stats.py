"""Speculative-decoding counters, defined as vLLM defines them.

- num_drafts: verification steps (a request's decode that carried >= 1 drafted id);
- num_draft_tokens / num_accepted_tokens: drafted ids verified / accepted;
- accepted per position: how often draft position i (0-based) was accepted;
- mean acceptance length = 1 + accepted / num_drafts (tokens per verification).

Besides vLLM's, `tokens_per_decode_forward` counts every decode forward of a request,
with or without a draft (a step without a draft commits 1 token): the issue's bar.
"""


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * max(1, num_speculative_tokens)
        self.num_decode_forwards = 0  # a request's decode steps, drafted or not
        self.num_decode_tokens = 0  # ids those steps committed

    def record_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if num_accepted > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_decode(self, num_tokens: int) -> None:
        self.num_decode_forwards += 1
        self.num_decode_tokens += num_tokens

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def tokens_per_decode_forward(self) -> float:
        if not self.num_decode_forwards:
            return 0.0
        return self.num_decode_tokens / self.num_decode_forwards

    def to_stats(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            "spec_accepted_tokens_per_position": list(self.accepted_per_position),
            "num_decode_forwards": self.num_decode_forwards,
            "num_decode_tokens": self.num_decode_tokens,
            "tokens_per_decode_forward": self.tokens_per_decode_forward,
        }
