"""The most any drafter that copies from the context could reach on the fixed workload.

With forced outputs, whether a draft is accepted depends only on the forced ids, not on
the model, so acceptance can be bounded without running it. The copy oracle is the best a
context drafter could ever do: at each verification it drafts the longest run of the
coming forced ids that occurs anywhere in what is committed so far (the prompt plus the
ids already decoded), capped at k. Real drafters must choose their continuation before
seeing the output (the n-gram drafter: the latest occurrence of the context's last few
ids), so they sit below it. One verification commits the accepted drafts plus one token
of its own, and the first output token comes from the prefill, not a decode step: both
exactly as the engine counts tokens per target forward.

Search: ids map one-to-one to characters, so "occurs in the context" is a substring test.
"""

from once.bench.spec_bench.workload import SpecCall

UNLIMITED = 1 << 30


def _as_text(ids) -> str:
    return "".join(map(chr, ids))  # token ids are far below 0x110000


def oracle_forwards(prompt_ids, output_ids, max_draft: int) -> int:
    """Target forwards the copy oracle needs to commit `output_ids` after `prompt_ids`."""
    output = _as_text(output_ids)
    committed = _as_text(prompt_ids)
    forwards, pos = 0, 0
    while pos < len(output):
        # The last token is always the verification's own: at most len - pos - 1 drafts.
        limit = min(max_draft, len(output) - pos - 1)
        accepted = 0
        while accepted < limit and output[pos : pos + accepted + 1] in committed:
            accepted += 1
        committed += output[pos : pos + accepted + 1]
        pos += accepted + 1
        forwards += 1
    return forwards


def copy_ceiling(calls: list[SpecCall], draft_lengths=(1, 2, 3, 4, 8, 16)) -> dict:
    """Tokens per target forward of the copy oracle over all decode steps, per draft
    length k (and unlimited)."""
    decoded = [(c.prompt_ids + c.output_ids[:1], c.output_ids[1:]) for c in calls]
    total = sum(len(output) for _, output in decoded)
    result = {}
    for k in (*draft_lengths, UNLIMITED):
        forwards = sum(oracle_forwards(context, output, k) for context, output in decoded)
        result["unlimited" if k == UNLIMITED else str(k)] = total / forwards if forwards else 0.0
    return result
