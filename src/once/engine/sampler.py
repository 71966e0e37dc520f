"""Token selection: forced ids, greedy, or temperature / top-k / top-p sampling.

Greedy rows (the common case for agents and replays) share one argmax over the batch.
Sampled rows are handled one by one so each can use its own seeded generator: a request
with a seed draws the same tokens whatever else is in the batch.
"""

import torch

from once.engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request], default_gen: torch.Generator):
    """logits: (N, vocab) float32, one row per request. Returns N token ids."""
    token_ids = [0] * len(requests)
    greedy_rows, sampled_rows = [], []
    for row, request in enumerate(requests):
        forced = request.next_forced_token()
        if forced is not None:
            token_ids[row] = forced
        elif request.sampling.greedy:
            greedy_rows.append(row)
        else:
            sampled_rows.append(row)
    if greedy_rows:
        rows = logits if len(greedy_rows) == logits.shape[0] else logits[greedy_rows]
        picks = rows.argmax(dim=-1).tolist()
        for row, token in zip(greedy_rows, picks, strict=True):
            token_ids[row] = token
    for row in sampled_rows:
        request = requests[row]
        gen = request.generator or default_gen
        # Generators live on the CPU; one row of logits is cheap to move there.
        token_ids[row] = sample_row(logits[row].cpu(), request.sampling, gen)
    return token_ids


def sample_row(logits: torch.Tensor, params, generator: torch.Generator) -> int:
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        cumulative = sorted_probs.cumsum(-1)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
