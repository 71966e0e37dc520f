"""Token masks of constrained rows: filled while the forward runs, applied before sampling.

Per step:
  1. `GrammarMasks.start(scheduled)`, before the forward: the constrained requests that
     sample this step get one bitmask row each. Their matchers' states depend on
     committed ids only, so the masks can be computed before the logits exist: one
     llguidance parallel fill on a worker thread (llguidance drops the GIL and spreads
     the matchers over its own threads), turned on the same thread into a (n, vocab)
     float bias: 0 where a row may take the id, -FLT_MAX where it may not.
  2. `StepMasks.apply(logits, sampled)`, after the forward: waits for the fill (done by
     then unless the grammar is unusually costly) and adds the bias to the constrained
     rows only (`index_add_`); every other row is left as the forward wrote it.

Costs on 8 x 49k logits here (a decode step of 8 is ~40 ms): the add 0.04-0.06 ms where
`masked_fill` took 1-3 ms on the critical path; building the bias as (allowed - 1) x
FLT_MAX 0.1 ms where `np.where(allowed, 0, -inf)` took 1.5 ms of the worker's CPU,
which the forward's threads share on a small machine. -FLT_MAX is as good as -inf
after softmax (exp underflows to 0) and a logit plus it stays finite.

Bit layout (llguidance's): token t is bit t % 32 of int32 word t // 32; on a
little-endian machine that is bit t % 8 of byte t // 8, which is what
`np.unpackbits(..., bitorder="little")` reads.

llguidance.numpy, not llguidance.torch: the torch module compiles its apply kernel with
torch.compile at import (4 s of torch._dynamo here, and a C++ compiler at first use);
its fill is the same executor call, and one masked_fill applies the mask on any device.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from once.engine.request import Request
from once.engine.scheduler import ScheduledRequest

FLT_MAX = float(np.finfo(np.float32).max)
NO_TOKEN_ALLOWED = "the grammar allows no token of this model's vocabulary here"


class GrammarMasks:
    def __init__(self, vocab_size: int, num_threads: int | None = None):
        self.vocab_size = vocab_size
        # None: llguidance's default pool (80% of the cores, at most 32).
        self._executor = llguidance.LLExecutor(num_threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="once-masks")
        # Whether the fill hides behind the forward: its time on the worker, and the time
        # the step waited for it after the forward (0 when fully overlapped).
        self.num_masks = 0
        self.fill_s = 0.0
        self.wait_s = 0.0

    def start(self, scheduled: list[ScheduledRequest]) -> "StepMasks | None":
        """Start filling this step's masks; None when no sampled row is constrained."""
        requests = [s.request for s in scheduled if s.request.grammar is not None and s.samples]
        if not requests:
            return None
        self.num_masks += len(requests)
        return StepMasks(self, requests, self._worker.submit(self._fill, requests))

    def stats(self) -> dict:
        return {
            "num_grammar_masks": self.num_masks,
            "grammar_mask_fill_s_total": self.fill_s,
            "grammar_mask_wait_s_total": self.wait_s,
        }

    def _fill(self, requests: list[Request]) -> tuple[torch.Tensor, list[str | None]]:
        started = time.perf_counter()
        bitmask = llguidance.numpy.allocate_token_bitmask(len(requests), self.vocab_size)
        grammars = [request.grammar for request in requests]
        assert all(g is not None for g in grammars)  # start() picks constrained rows only
        matchers = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        allowed = np.unpackbits(
            bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little"
        )
        errors = [g.error if g is not None else None for g in grammars]
        # An empty mask would turn the row's softmax into NaNs: fail the request instead.
        for i in np.flatnonzero(~allowed.any(axis=1)):
            errors[i] = errors[i] or NO_TOKEN_ALLOWED
        bias = allowed.astype(np.float32)
        bias -= 1.0
        bias *= FLT_MAX  # 0 where allowed, -FLT_MAX where not
        self.fill_s += time.perf_counter() - started
        return torch.from_numpy(bias), errors


class StepMasks:
    """One step's masks: the requests they belong to and the fill under way."""

    def __init__(self, masks: GrammarMasks, requests: list[Request], fill: Future):
        self.masks = masks
        self.requests = requests
        self._fill = fill

    def wait(self) -> None:
        self._fill.exception()  # returns once the fill is over, failed or not

    def apply(self, logits: torch.Tensor, sampled: list[Request]) -> list[tuple[Request, str]]:
        """Mask the constrained rows of `logits` (N, vocab) in place; `sampled` are the
        requests owning its rows in order, 1 + len(drafts) rows each. Returns the
        requests whose matcher failed, with the reason; their rows are left unmasked
        and the engine fails them rather than sample from them."""
        waited = time.perf_counter()
        try:
            bias, errors = self._fill.result()
            self.masks.wait_s += time.perf_counter() - waited
        except Exception as exc:  # never the step loop's end: these requests fail alone
            return [(request, f"mask fill failed: {exc!r}") for request in self.requests]
        first_row, row = {}, 0
        for request in sampled:
            first_row[request.request_id] = row
            row += 1 + len(request.draft_token_ids)
        rows, kept, failed = [], [], []
        for i, request in enumerate(self.requests):
            if errors[i] is not None:
                failed.append((request, errors[i]))
            elif request.request_id in first_row:  # constrained rows carry no drafts
                rows.append(first_row[request.request_id])
                kept.append(i)
        if rows:
            index = torch.tensor(rows, device=logits.device)
            if len(kept) < len(self.requests):
                bias = bias[kept]
            bias = bias.to(logits.device, logits.dtype, non_blocking=True)
            with torch.inference_mode():  # the forward's logits are inference tensors
                logits.index_add_(0, index, bias)
        return failed
