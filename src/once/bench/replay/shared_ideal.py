"""The bound no cache can beat: an unlimited prefix cache shared by every session.

once's engine keeps one prefix cache for all requests of a tenant, so a session's second
call can reuse a prefix that another session computed. The per-session reference
(reference.py) does not see that, and once beats it. This bound does not depend on the
order calls ran in:

A prompt position is a node of the trie of all prompts (the prefix that ends there). Its
K/V has to be made at least once, by some request that has that prefix: in a prefill
(one computed prompt token), or for free while decoding, if the node lies in the output
part of some request+output. So no stack, however it shares, orders or evicts, computes
fewer prompt tokens than

    |prompt prefixes| - |prompt prefixes inside some request+output's output part|

Per source folder the bound counts only the nodes no other folder's prompt holds (those
could have been computed by the other folder's calls), so per-folder bounds add up to at
most the total. It is generous to the cache: whole blocks, the last prompt token always
computed, and the last output token never having K/V are the engine's costs, not its.

Nodes are 64-bit keys: a polynomial prefix hash mod 2^64 (numpy's wrapping uint64
arithmetic) mixed with the depth, collisions being ~1e-19 per pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible mod 2^64
_DEPTH_MIX = np.uint64(0xC2B2AE3D27D4EB4F)


def prefix_keys(ids: Sequence[int]) -> np.ndarray:
    """One key per prefix ids[:d], d = 1..len(ids)."""
    tokens = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    n = len(tokens)
    # h_d = sum_{i<d} t_i B^(d-1-i) = B^(d-1) * sum_{i<d} t_i B^-i  (mod 2^64)
    with np.errstate(over="ignore"):
        powers = _powers(_BASE, n)
        inverse_powers = _powers(np.uint64(pow(int(_BASE), -1, 1 << 64)), n)
        hashes = powers * np.cumsum(tokens * inverse_powers, dtype=np.uint64)
        return hashes ^ (np.arange(1, n + 1, dtype=np.uint64) * _DEPTH_MIX)


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64."""
    powers = np.ones(n, dtype=np.uint64)
    if n > 1:
        powers[1:] = np.cumprod(np.full(n - 1, base, dtype=np.uint64), dtype=np.uint64)
    return powers


def _keys(calls: Iterable[tuple[Sequence[int], Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(keys of every prompt prefix, keys of every prefix inside an output part)."""
    prompts, free = [], []
    for prompt, output in calls:
        keys = prefix_keys([*prompt, *output])
        prompts.append(keys[: len(prompt)])
        free.append(keys[len(prompt) :])
    return _union(prompts), _union(free)


def shared_ideal_tokens(
    groups: Mapping[str, Sequence[tuple[Sequence[int], Sequence[int]]]],
) -> dict[str, int]:
    """Fewest prompt tokens any cache shared across all sessions computes: per group
    (the nodes only it holds) and under "total" (all groups at once).

    groups maps a name (a source folder) to its calls as (prompt ids, output ids)."""
    keys = {name: _keys(calls) for name, calls in groups.items()}
    all_free = _union([free for _, free in keys.values()])
    bound: dict[str, int] = {}
    for name, (prompt_keys, _) in keys.items():
        held_elsewhere = _union([keys[other][0] for other in keys if other != name])
        own = np.setdiff1d(prompt_keys, held_elsewhere, assume_unique=True)
        bound[name] = int(len(np.setdiff1d(own, all_free, assume_unique=True)))
    every_prompt = _union([prompt_keys for prompt_keys, _ in keys.values()])
    bound["total"] = int(len(np.setdiff1d(every_prompt, all_free, assume_unique=True)))
    return bound


def _union(arrays: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(arrays)) if arrays else np.zeros(0, dtype=np.uint64)
