"""Rejection sampling is lossless: committed ids follow the target distribution exactly."""

import pytest
import torch
from scipy.stats import chisquare

from once.engine.speculative.verify import accept_matching, rejection_sample, sampling_probs
from once.protocol.engine import SamplingParams

NUM_SAMPLES = 6000


def target_rows(tiny_reference, context, params):
    with torch.no_grad():
        logits = tiny_reference(torch.tensor([context])).logits[0, -2:]
    return sampling_probs(logits, params)  # (2, vocab): rows for positions n-1 and n


def binned(probs: torch.Tensor, top: list[int]) -> list[float]:
    """The top ids' probabilities and the rest's, summing to 1 in float64 (chisquare checks)."""
    top_probs = [float(probs[t]) for t in top]
    return top_probs + [1.0 - sum(top_probs)]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_first_token_follows_the_target_distribution(tiny_reference, with_draft_probs):
    params = SamplingParams(temperature=1.0)
    p = target_rows(tiny_reference, [5, 9, 13, 200, 17], params)
    top = p[0].argsort(descending=True)[:6].tolist()
    draft = top[1]  # a plausible but not the likeliest id
    generator = torch.Generator().manual_seed(1)
    q = None
    if with_draft_probs:  # a draft model's own distribution, different from the target
        q = torch.softmax(torch.randn(1, p.shape[1], generator=generator), -1)
    counts = [0] * (len(top) + 1)
    num_two = 0
    for _ in range(NUM_SAMPLES):
        if q is not None:  # a draft model's draft is drawn from its own distribution
            draft = int(torch.multinomial(q[0], 1, generator=generator))
        out = rejection_sample(p, [draft], q, generator)
        assert 1 <= len(out) <= 2
        if len(out) == 2:
            assert out[0] == draft
            num_two += 1
        first = out[0]
        counts[top.index(first) if first in top else len(top)] += 1
    expected = [NUM_SAMPLES * f for f in binned(p[0], top)]
    assert chisquare(counts, expected).pvalue > 1e-3
    # Two ids come out exactly when the draft was accepted.
    # P(accept) = p(x) for a fixed draft x; sum_x min(p(x), q(x)) for x ~ q.
    accept = float(p[0][draft]) if q is None else float(torch.minimum(p[0], q[0]).sum())
    assert abs(num_two / NUM_SAMPLES - accept) < 4 * (accept * (1 - accept) / NUM_SAMPLES) ** 0.5


def test_bonus_token_follows_the_next_row(tiny_reference):
    params = SamplingParams(temperature=0.8, top_k=20)
    p = target_rows(tiny_reference, [5, 9, 13, 200, 17], params)
    draft = int(p[0].argmax())
    top = p[1].argsort(descending=True)[:6].tolist()
    generator = torch.Generator().manual_seed(2)
    counts = [0] * (len(top) + 1)
    num_bonus = 0
    while num_bonus < 3000:
        out = rejection_sample(p, [draft], None, generator)
        if len(out) == 2:
            num_bonus += 1
            counts[top.index(out[1]) if out[1] in top else len(top)] += 1
    expected = [3000 * f for f in binned(p[1], top)]
    assert chisquare(counts, expected).pvalue > 1e-3


def test_sampling_probs_respect_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    top_k = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[0, 2:] == 0).all() and top_k.sum().item() == pytest.approx(1.0)
    top_p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert top_p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_accept_matching_takes_the_agreeing_prefix_plus_one():
    assert accept_matching([1, 2, 3], [1, 2, 9, 4]) == [1, 2, 9]
    assert accept_matching([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_matching([5], [1, 7]) == [1]
    assert accept_matching([1, 2, 3], [1, 2]) == [1, 2]  # a forced output that ends
