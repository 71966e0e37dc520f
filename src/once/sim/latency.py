"""Inter-token latency in the simulator: every decode step's duration, once per sequence.

A sequence that is decoding takes part in every step of its replica (the simulated
scheduler never preempts), so the gap between two of its tokens is the duration of the
step that made the second one. The distribution of inter-token latencies over all tokens
is then the distribution of step durations, each weighted by the number of sequences that
decoded in that step. A 30-minute trace has millions of such tokens, so they go into a
histogram with log-spaced bins (relative width 0.7%, from 10 us to 1,000 s): a percentile
read from it is within that width of the exact one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MIN_S = 1e-5
MAX_S = 1e3
NUM_BINS = 2700  # (MAX_S / MIN_S) ** (1 / NUM_BINS) = 1.0069 per bin


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = [0] * NUM_BINS
        self.total = 0
        self._log_min = math.log(MIN_S)
        self._scale = NUM_BINS / (math.log(MAX_S) - self._log_min)

    def add(self, seconds: float, weight: int = 1) -> None:
        if weight <= 0:
            return
        clamped = min(max(seconds, MIN_S), MAX_S * 0.999999)
        self.counts[int((math.log(clamped) - self._log_min) * self._scale)] += weight
        self.total += weight

    def add_linear_span(self, first_s: float, growth_s: float, num_steps: int, weight: int) -> None:
        """A decode span: steps of first_s, first_s + growth_s, ... (num_steps of them)."""
        if growth_s == 0:
            self.add(first_s, weight * num_steps)
            return
        for k in range(num_steps):
            self.add(first_s + growth_s * k, weight)

    def merge(self, others: Iterable[LatencyHistogram]) -> LatencyHistogram:
        for other in others:
            for i, count in enumerate(other.counts):
                if count:
                    self.counts[i] += count
            self.total += other.total
        return self

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100), as its bin's geometric middle; NaN when empty."""
        if not self.total:
            return float("nan")
        rank = q / 100 * self.total
        seen = 0
        for i, count in enumerate(self.counts):
            seen += count
            if count and seen >= rank:
                return math.exp(self._log_min + (i + 0.5) / self._scale)
        return MAX_S

    def mean(self) -> float:
        if not self.total:
            return float("nan")
        weighted = sum(
            count * math.exp(self._log_min + (i + 0.5) / self._scale)
            for i, count in enumerate(self.counts)
            if count
        )
        return weighted / self.total
