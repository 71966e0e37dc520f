"""Log probabilities of the ids a step commits, for the requests that ask for them.

The distribution: the model's own, `log_softmax` of the logits as the forward wrote them,
before temperature, top-k and top-p. That is vLLM's default (`logprobs_mode =
"raw_logprobs"`), so once engines and vLLM replicas behind one router report the same
kind of number; it does not depend on how a request samples (a greedy and a sampled run
over the same text report the same values, which scoring and evals rely on), and it is
what a reference forward gives, so it can be tested one to one against transformers. The
processed distribution would also say little for greedy rows (0 for the argmax, -inf for
every other id).

Constrained rows report the masked distribution: the grammar's bias is added to the
logits in place before any id is chosen (masks.py), and the logprobs are read after it.
vLLM does the same (its bitmask is applied before its sampler reads the raw logprobs),
the token was drawn among the ids the grammar allowed, and the alternatives a caller sees
are ones the grammar could have produced. Ids the mask removed (logit - FLT_MAX) are left
out of the alternatives, so a row whose grammar allows fewer than k ids reports fewer.

Rows: a sampled request owns 1 + len(drafts) consecutive rows of the step's logits
(runner.py), and committed id j came from row j: for a verification, row j scores the
token after draft position j (an accepted draft, then the corrected or bonus id). Forced
ids (replays) are read the same way: the model's logprob of the id it was made to take.

Cost: requests that did not ask add one attribute check each. For those that did: one
gather of their committed rows, one log_softmax over them, a gather of the chosen ids and
one topk with the step's largest k, each moved to Python with one `tolist`.
"""

import torch

from once.engine.request import Request
from once.protocol.engine import TokenLogprob

# Below any real logprob, above a masked id's (about -3.4e38) or -inf.
IMPOSSIBLE_LOGPROB = -1e30


def token_logprobs(
    logits: torch.Tensor, requests: list[Request], committed: list[list[int]]
) -> dict[str, list[TokenLogprob]]:
    """logits: (N, vocab), 1 + len(drafts) rows per request of `requests`, in order;
    committed[i]: the ids requests[i] commits. Returns, for each request that asked, one
    entry per committed id (the step may stop a request earlier: callers cut the list)."""
    rows: list[int] = []
    chosen_ids: list[int] = []
    asking: list[tuple[str, int, int]] = []  # (request id, k, number of its rows)
    row = 0
    for request, token_ids in zip(requests, committed, strict=True):
        k = request.sampling.logprobs
        if k is not None:
            rows.extend(range(row, row + len(token_ids)))
            chosen_ids.extend(token_ids)
            asking.append((request.request_id, k, len(token_ids)))
        row += 1 + len(request.draft_token_ids)
    if not asking:
        return {}

    device = logits.device
    max_k = min(max(k for _, k, _ in asking), logits.shape[-1])
    with torch.inference_mode():
        picked = logits.index_select(0, torch.tensor(rows, device=device))
        logprobs = torch.log_softmax(picked.float(), dim=-1)  # (n, vocab)
        ids = torch.tensor(chosen_ids, device=device).unsqueeze(1)
        chosen = logprobs.gather(1, ids).squeeze(1).tolist()
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if max_k:
            top = logprobs.topk(max_k, dim=-1)  # sorted, most likely first
            top_values, top_ids = top.values.tolist(), top.indices.tolist()

    out: dict[str, list[TokenLogprob]] = {}
    first = 0
    for request_id, k, num_rows in asking:
        entries = []
        for i in range(first, first + num_rows):
            alternatives = tuple(
                (token_id, value)
                for token_id, value in zip(top_ids[i][:k], top_values[i][:k], strict=True)
                if value > IMPOSSIBLE_LOGPROB
            )
            entries.append(TokenLogprob(chosen_ids[i], chosen[i], alternatives))
        out[request_id] = entries
        first += num_rows
    return out
