"""Seeded synthetic prompts: random token ids, all of one length, inside the vocabulary."""

import random

# Real SmolLM2 ids 100..40000 skip the special tokens at the bottom of the vocabulary; a
# tiny test model (vocab 256) gets the same shape of range, scaled to its vocabulary.
LOW_ID, HIGH_ID = 100, 40000


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Half-open [low, high) range of ids to draw from."""
    return min(LOW_ID, vocab_size // 4), min(HIGH_ID, vocab_size)


def random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    low, high = token_id_range(vocab_size)
    return [rng.randrange(low, high) for _ in range(length)]


def random_prompts(num: int, length: int, vocab_size: int, seed: str) -> list[list[int]]:
    # String seeds: distinct workloads never share ids (int seeds -1 and 1 are one stream).
    rng = random.Random(seed)
    return [random_ids(rng, length, vocab_size) for _ in range(num)]
