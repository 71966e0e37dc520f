"""Cost-aware draft length: each step drafts only as many ids as pay for their rows.

A verification adds rows to the step. On a GPU at small batch an extra row is nearly free
(the step is bound by reading the weights); on a CPU each row is compute, more of it the
longer the context, and at batch 8, where the step is compute-bound already, rows cost
their full share. A fixed draft length then wins at batch 1 and loses at batch 8. The
governor picks, before each step, the length k <= K that maximizes committed tokens per
second of step time:

    tokens(k) = B + B * sum_{j=1..k} p_j       B decoding requests, each drafting k ids
    time(k)   = a + b * B * (1 + k)            a step is linear in the rows it runs

- p_j: how often a draft that reached position j had positions 1..j all accepted, counted
  from this engine's verifications (decayed, so it follows the workload), with a prior of
  one success in two tries, so unseen positions are neither trusted nor ruled out;
- a, b: decayed least squares of decode-only step times against their rows.

Until both have data (and every `explore_every` steps after, so that p_j keeps being
measured when the choice is k = 0) the full K is drafted.
"""

DECAY = 0.98  # per observation: about the last 50 steps or verifications count


class DraftLengthGovernor:
    def __init__(self, max_tokens: int, explore_every: int = 16):
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self.explore_every = explore_every
        self.reached = [0.0] * max_tokens  # drafts that had a position j (index j - 1)
        self.all_accepted = [0.0] * max_tokens  # ... and 1..j all accepted
        self._fit = [0.0] * 5  # weight, x, y, xx, xy: x = rows, y = step seconds
        self._num_steps = 0
        self._num_choices = 0

    # -- what the engine reports -------------------------------------------------------

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(self.max_tokens):
            self.reached[j] *= DECAY
            self.all_accepted[j] *= DECAY
        for j in range(min(num_drafts, self.max_tokens)):
            self.reached[j] += 1.0
            if j < num_accepted:
                self.all_accepted[j] += 1.0

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only step (no prompt tokens) that ran `num_rows` rows."""
        x, y = float(num_rows), float(seconds)
        self._num_steps += 1
        self._fit = [DECAY * s for s in self._fit]
        for i, term in enumerate((1.0, x, y, x * x, x * y)):
            self._fit[i] += term

    # -- the choice --------------------------------------------------------------------

    def acceptance_chain(self) -> list[float]:
        """p_j for j = 1..K, with the prior (one success in two tries)."""
        return [(a + 1.0) / (r + 2.0) for a, r in zip(self.all_accepted, self.reached, strict=True)]

    def step_cost(self) -> tuple[float, float] | None:
        """(a, b) of step seconds = a + b * rows, or None until the rows have varied."""
        n, sx, sy, sxx, sxy = self._fit
        if self._num_steps < 2:
            return None
        spread = sxx - sx * sx / n
        if spread <= 1e-9 * max(1.0, sxx):
            return None
        b = (sxy - sx * sy / n) / spread
        a = (sy - b * sx) / n
        return max(a, 0.0), max(b, 0.0)

    def draft_length(self, num_decoding: int) -> int:
        self._num_choices += 1
        cost = self.step_cost()
        if cost is None or num_decoding < 1 or self._num_choices % self.explore_every == 0:
            return self.max_tokens
        a, b = cost
        chain = self.acceptance_chain()
        best_k, best_rate, expected = 0, 0.0, 0.0
        for k in range(self.max_tokens + 1):
            if k:
                expected += chain[k - 1]
            seconds = a + b * num_decoding * (1 + k)
            rate = num_decoding * (1 + expected) / seconds if seconds > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k
