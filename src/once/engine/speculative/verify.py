"""Verification of drafted tokens against the target's k + 1 rows of logits.

Row i of the target's logits is its distribution for the token after draft position i
(row 0 follows the last committed token). Three cases:

  - forced ids: the "target" token at row i is the forced id; accept drafts while they
    equal it, then take the next forced id.
  - greedy: accept drafts while they equal the row's argmax, then take the argmax of the
    first row that disagreed (or of row k if all were accepted). Output is identical to
    decoding one token at a time.
  - temperature > 0, rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept
    draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection sample
    from the residual norm(max(0, p_i - q_i)) and stop; if all are accepted sample a bonus
    token from p_k. The output is distributed exactly as sampling from p token by token.
    A deterministic drafter (n-gram, suffix) has q_i = one-hot(x_i), so acceptance is
    p_i(x_i) and the residual is p_i with x_i removed.
"""

import torch

from once.protocol.engine import SamplingParams


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(rows, vocab) logits -> the distribution `sampler.sample_row` draws from, per row."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_matching(drafts: list[int], targets: list[int]) -> list[int]:
    """Greedy or forced acceptance: targets has len(drafts) + 1 ids (or fewer, when the
    forced output ends). Returns the committed ids: the agreeing prefix plus one more."""
    num_accepted = 0
    while num_accepted < min(len(drafts), len(targets) - 1):
        if drafts[num_accepted] != targets[num_accepted]:
            break
        num_accepted += 1
    return targets[: num_accepted + 1]


def rejection_sample(
    target_probs: torch.Tensor,  # (k + 1, vocab)
    drafts: list[int],
    draft_probs: torch.Tensor | None,  # (k, vocab), or None for deterministic drafts
    generator: torch.Generator,
) -> list[int]:
    """Returns the committed ids: accepted drafts plus one corrected or bonus token."""
    target_probs = target_probs.cpu().double()
    if draft_probs is not None:
        draft_probs = draft_probs.cpu().double()
    out: list[int] = []
    for i, token in enumerate(drafts):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i]
        ratio = float(p[token] / q[token]) if q[token] > 0 else 0.0
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u < ratio:
            out.append(token)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q: a rejection has probability 0; guard rounding
            residual, total = p, float(p.sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out
