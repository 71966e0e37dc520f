"""The n-gram and suffix drafters on their own."""

import pytest

from once.engine.request import Request
from once.engine.speculative.index import NgramIndex, longest_match
from once.engine.speculative.ngram import NgramDrafter
from once.engine.speculative.suffix import SuffixDrafter
from once.protocol.engine import GenerateRequest


def request(rid, tokens, session=None):
    return Request(GenerateRequest(rid, tuple(tokens), session_key=session), (2,), 10_000)


def test_index_finds_the_longest_earlier_match():
    index = NgramIndex((1, 2, 4))
    index.add_sequence([1, 2, 3, 4, 9, 2, 3, 4])
    n, found = longest_match([index], [9, 9, 2, 3, 4], (1, 2, 4))
    assert n == 2 and [(s, p) for _, s, p in found] == [(0, 4)]
    with pytest.raises(ValueError):
        NgramIndex((0, 2))


def test_ngram_proposes_what_followed_the_latest_occurrence():
    drafter = NgramDrafter(min_n=2, max_n=3)
    r = request("a", [10, 11, 12, 13, 50, 10, 11, 12, 14, 60, 10, 11])
    draft = drafter.propose([r], [3])[0]
    assert draft.token_ids == [12, 14, 60]  # the latest "10 11" was followed by 12 14 60
    assert drafter.propose([request("b", [1, 2, 3])], [3])[0].token_ids == []
    assert drafter.propose([r], [0])[0].token_ids == []


def test_ngram_index_grows_with_committed_tokens_only():
    drafter = NgramDrafter(min_n=1, max_n=2)
    r = request("a", [1, 2, 3, 4])
    assert drafter.propose([r], [2])[0].token_ids == []
    r.append_output(2)
    assert drafter.propose([r], [2])[0].token_ids == [3, 4]
    drafter.on_finished(r)
    assert "a" not in drafter.contexts.by_request


def test_suffix_draft_length_follows_match_length_and_confidence():
    drafter = SuffixDrafter(alpha=1.0, min_score=0.3, min_match=1)
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    r = request("a", text + [40] + [5, 6, 7])  # a 3-token match: at most 3 drafted
    assert drafter.propose([r], [8])[0].token_ids == [8, 9, 10]
    long = request("b", text + [40] + [5, 6, 7, 8, 9, 10])
    # A 6-token match earns 6 ids: the copy runs on through what followed.
    assert drafter.propose([long], [8])[0].token_ids == [11, 12, 13, 40, 5, 6]
    # Two equally frequent continuations: the first id has confidence 0.5, enough for
    # min_score 0.3 (then one path remains), not for 0.6.
    branchy = [1, 2, 3, 70, 1, 2, 3, 71, 1, 2, 3]
    assert drafter.propose([request("c", branchy)], [8])[0].token_ids == [70, 1, 2]
    cautious = SuffixDrafter(alpha=1.0, min_score=0.6, min_match=1)
    assert cautious.propose([request("c", branchy)], [8])[0].token_ids == []


def test_suffix_uses_earlier_outputs_of_the_same_session():
    drafter = SuffixDrafter(min_match=2)
    first = request("a", [100, 101], session="s")
    for t in [7, 8, 9, 10, 11, 12]:
        first.append_output(t)
    drafter.on_finished(first)
    later = request("b", [300, 7, 8, 9], session="s")
    assert drafter.propose([later], [3])[0].token_ids == [10, 11, 12]
    stranger = request("c", [300, 7, 8, 9], session="other")
    assert drafter.propose([stranger], [3])[0].token_ids == []


def test_suffix_sessions_are_bounded():
    drafter = SuffixDrafter(session_budget_tokens=10, max_sessions=2)
    for i, session in enumerate(["s1", "s2", "s3", "s3"]):
        r = request(f"r{i}", [1], session=session)
        for t in range(8):
            r.append_output(50 + t)
        drafter.on_finished(r)
    assert list(drafter.sessions) == ["s2", "s3"]
    assert sum(len(s) for s in drafter.sessions["s3"].sequences) <= 10
    with pytest.raises(ValueError):
        SuffixDrafter(alpha=0)
