"""An incremental n-gram index over growing token sequences: where each n-gram ended.

For every token appended at index i of sequence s, and every n in `lengths` with i + 1 >= n,
the key `tokens[i + 1 - n : i + 1]` maps to the continuation point (s, i + 1): the token
that followed that occurrence (if any) sits at tokens[i + 1].

    tokens     a  b  c  a  b  ?
    index      0  1  2  3  4  5
    "a b" -> [(s, 2), (s, 5)]      the second occurrence has no continuation yet

Matching a context's suffix is then one dict lookup per length; lengths are geometric
(1, 2, 3, 4, 6, 8, ...) so indexing costs a few tuples per token while long matches stay
visible. If a suffix of length n occurs, every shorter one does too, so the longest match
among `lengths` is found by trying them from the longest down.
"""

DEFAULT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

# Occurrences kept per key: the most recent ones, which predict copying best.
MAX_OCCURRENCES_PER_KEY = 64


class NgramIndex:
    def __init__(self, lengths: tuple[int, ...] = DEFAULT_LENGTHS):
        if not lengths or any(n < 1 for n in lengths):
            raise ValueError(f"n-gram lengths must be positive, got {lengths}")
        self.lengths = tuple(sorted(set(lengths)))
        self.sequences: list[list[int]] = []
        self.positions: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def add_sequence(self, tokens=()) -> int:
        self.sequences.append([])
        seq_id = len(self.sequences) - 1
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, new_tokens) -> None:
        seq = self.sequences[seq_id]
        positions = self.positions
        for token in new_tokens:
            seq.append(token)
            end = len(seq)
            for n in self.lengths:
                if n > end:
                    break
                key = tuple(seq[end - n : end])
                found = positions.get(key)
                if found is None:
                    positions[key] = [(seq_id, end)]
                else:
                    found.append((seq_id, end))
                    if len(found) > 2 * MAX_OCCURRENCES_PER_KEY:
                        del found[:MAX_OCCURRENCES_PER_KEY]

    def continuations(self, key: tuple[int, ...]) -> list[tuple[int, int]]:
        """Occurrences of `key` that have at least one following token, oldest first."""
        found = self.positions.get(key, ())
        return [(s, p) for s, p in found if p < len(self.sequences[s])]

    def token_at(self, seq_id: int, pos: int) -> int | None:
        seq = self.sequences[seq_id]
        return seq[pos] if pos < len(seq) else None


def longest_match(
    indexes: list[NgramIndex], context: list[int], lengths: tuple[int, ...]
) -> tuple[int, list[tuple[NgramIndex, int, int]]]:
    """The longest n in `lengths` whose last-n-token suffix of `context` occurred before in
    any of `indexes` with a continuation; returns (n, [(index, seq_id, pos)]) or (0, [])."""
    for n in sorted(lengths, reverse=True):
        if n > len(context):
            continue
        key = tuple(context[-n:])
        found = [(index, s, p) for index in indexes for s, p in index.continuations(key)]
        if found:
            return n, found
    return 0, []
