"""Speculative decoding: drafters (n-gram, suffix, draft model), verification, counters.

Drafters: "ngram" and "suffix" copy from the request's context (and its session's earlier
outputs); "draft" runs a smaller model with the target's tokenizer (`draft_model.py`),
which samples its drafts for temperature > 0 and hands verification its probabilities.

The engine asks its drafter for up to k ids per decoding request before scheduling, the
scheduler gives each such request 1 + k tokens of the step's budget, the runner computes
all 1 + k rows of logits in the same flat batch as everything else, and the engine commits
the accepted ids (`verify.py`) and rolls back the K/V blocks of the rejected ones.
"""

from once.engine.speculative.drafter import Draft, Drafter
from once.engine.speculative.stats import SpecDecodeStats

METHODS = ("ngram", "suffix", "draft")  # "draft" needs EngineConfig.draft_model

__all__ = ["METHODS", "Draft", "Drafter", "SpecDecodeStats", "make_drafter"]


def make_drafter(config, model_config) -> Drafter | None:
    """The drafter an EngineConfig asks for, or None when speculation is off."""
    method = config.speculative_method
    if not method:
        return None
    if config.num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1 when speculation is on")
    if method == "ngram":
        from once.engine.speculative.ngram import NgramDrafter

        return NgramDrafter()
    if method == "suffix":
        from once.engine.speculative.suffix import SuffixDrafter

        return SuffixDrafter()
    if method == "draft":
        if not config.draft_model:
            raise ValueError('speculative_method "draft" needs draft_model')
        from once.engine.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_config(config, model_config)
    raise ValueError(f"unknown speculative_method {method!r}; choose from {METHODS}")
