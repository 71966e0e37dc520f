"""The reference: what an unlimited per-session prefix cache would serve.

For call k of a session, the ideal cache holds every earlier request of the session and
every earlier request followed by its output (what a cache holds once the output's KV
is written). The call can reuse the longest common prefix of its prompt ids with any of
those sequences; the rest is new work no cache could avoid. The ideal ratio of a set of
sessions is then (sum of new tokens) / (sum of prompt tokens): what an ideal stack
computes relative to one that prefills every prompt in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReferenceCall:
    num_prompt_tokens: int
    num_ideal_cached: int  # longest common prefix with any earlier request or request+output
    num_previous_shared: int  # common prefix with the previous call's request+output
    previous_length: int  # length of the previous call's request+output (0 for the first)

    @property
    def num_ideal_new(self) -> int:
        return self.num_prompt_tokens - self.num_ideal_cached


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def reference_calls(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    previous_in_chain: Sequence[int | None] | None = None,
) -> list[ReferenceCall]:
    """One ReferenceCall per call; previous_in_chain[k] is the call k continues (or None).

    Without previous_in_chain, call k continues call k-1. A request+output sequence
    starts with its request, so comparing with it covers the request alone as well.
    """
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    if previous_in_chain is None:
        previous_in_chain = [None] + list(range(len(prompts) - 1))
    seen: list[np.ndarray] = []  # request+output of every earlier call
    calls = []
    for k, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"call {k} has an empty prompt")
        ids = np.asarray(prompt, dtype=np.int64)
        best = max((common_prefix_length(ids, earlier) for earlier in seen), default=0)
        previous = previous_in_chain[k]
        if previous is not None and not 0 <= previous < k:
            raise ValueError(f"call {k} continues call {previous}, which is not earlier")
        shared = 0 if previous is None else common_prefix_length(ids, seen[previous])
        previous_length = 0 if previous is None else len(seen[previous])
        calls.append(ReferenceCall(len(ids), best, shared, previous_length))
        seen.append(np.concatenate([ids, np.asarray(output, dtype=np.int64)]))
    return calls


def ideal_ratio(calls: Sequence[ReferenceCall]) -> float:
    total = sum(c.num_prompt_tokens for c in calls)
    return sum(c.num_ideal_new for c in calls) / total if total else 0.0
