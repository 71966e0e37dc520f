"""The paid-twice ledger: per layer, the work done vs the work that was new.

Every prompt token the engine computed is attributed to exactly one cause, so the causes
add up to the engine's own `num_computed_prompt_tokens`:

    first_call         the session's first request: nothing could be cached yet
    new_content        what this call appended past its chain's previous request+output
    prefix_changed:X   what the client re-sent changed (the cache doctor's cause X:
                       role_switch, history_edited, ...): new to any per-session cache
    block_boundary     ideal-cacheable tokens the engine computes because it caches whole
                       blocks only, always computes the last prompt token, and never
                       computes the KV of an output's last token
    no_prefix_cache    ideal-cacheable tokens of a stack without prefix cache (naive)
    evicted            ideal-cacheable tokens missed after the engine evicted blocks
    tier_miss          the same on a stack with KV tiers below the device: evicted from
                       the device and not brought back by a tier (gone from every tier,
                       or its load did not arrive in time)
    routed_elsewhere   ideal-cacheable tokens missed by a call on a replica that did not
                       serve all of the session's earlier calls: the prefix may live on
                       another replica (routed stacks only)
    preempted          prompt positions prefilled again after a preemption (the engine's
                       own count, `RequestMetrics.num_recomputed_tokens`)
    unattributed       ideal-cacheable tokens missed for no reason above: a bug to find

"Ideal-cacheable" is the reference (`reference.py`): the longest common prefix with any
earlier request or request+output of the session. A cache shared across sessions can
serve more than that (the same system prompt); such tokens are simply not computed, and
the bound no cache can beat is shared_ideal.py's.

Every call is checked against the invariants below (`check_call`); a replay that breaks
one reports it in `ledger_invariants` and exits 1:

    prompt   = cached + computed - recomputed      every prompt position obtained once
    cached  >= cached from a KV tier >= 0
    computed = sum of the call's causes, each >= 0  nothing computed without a cause
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

FIRST_CALL = "first_call"
NEW_CONTENT = "new_content"
PREFIX_CHANGED = "prefix_changed"
BLOCK_BOUNDARY = "block_boundary"
NO_PREFIX_CACHE = "no_prefix_cache"
EVICTED = "evicted"
TIER_MISS = "tier_miss"
ROUTED_ELSEWHERE = "routed_elsewhere"
PREEMPTED = "preempted"
UNATTRIBUTED = "unattributed"
# Causes of paying twice: tokens a cache held once, or could have, computed again.
PAID_TWICE = (EVICTED, TIER_MISS, ROUTED_ELSEWHERE, PREEMPTED, UNATTRIBUTED)


def attribute_call(
    record: dict,
    *,
    block_size: int,
    prefix_caching: bool,
    session_evictions: int,
    routed_elsewhere: bool = False,
    tiers: bool = False,
):
    """Split one call's computed prompt tokens into causes (a Counter summing to them,
    when the engine's counts keep the first invariant)."""
    causes: Counter[str] = Counter()
    prompt = record["prompt_tokens"]
    recomputed = record.get("recomputed_tokens", 0)
    computed_fresh = record["computed_tokens"] - recomputed
    if recomputed > 0:
        causes[PREEMPTED] += recomputed
    if record["index"] == 0 and record["ideal_cached"] == 0:
        if computed_fresh:
            causes[FIRST_CALL] += computed_fresh
        return causes
    ideal_cached = min(record["ideal_cached"], prompt)
    ideal_new = prompt - ideal_cached
    changed = 0
    if record["break_cause"] is not None:
        changed = max(0, min(prompt, record["previous_length"]) - ideal_cached)
    # A cache shared across sessions may serve some of the "new" tokens: count only what
    # was computed, changed tokens last (they sit before the appended ones).
    new_computed = min(computed_fresh, ideal_new)
    changed_computed = min(changed, new_computed)
    if changed_computed:
        causes[f"{PREFIX_CHANGED}:{record['break_cause']}"] += changed_computed
    if new_computed - changed_computed:
        causes[NEW_CONTENT] += new_computed - changed_computed
    missed = computed_fresh - new_computed  # ideal-cacheable, yet computed
    if missed <= 0:
        return causes
    if not prefix_caching:
        causes[NO_PREFIX_CACHE] += missed
        return causes
    # Whole blocks only; the last prompt token is always computed; and the previous
    # output's last token never went through the model, so it has no KV to reuse.
    effective = min(ideal_cached, prompt - 1)
    if 0 < record["previous_length"] <= ideal_cached:
        effective = min(effective, record["previous_length"] - 1)
    reachable = effective // block_size * block_size
    structural = min(missed, ideal_cached - reachable)
    if structural:
        causes[BLOCK_BOUNDARY] += structural
    missed -= structural
    if missed:
        if routed_elsewhere:  # first: evictions are counted over all replicas
            causes[ROUTED_ELSEWHERE] += missed
        elif session_evictions > 0:
            causes[TIER_MISS if tiers else EVICTED] += missed
        else:
            causes[UNATTRIBUTED] += missed
    return causes


def check_call(record: dict, causes: Counter[str]) -> list[str]:
    """The invariants one call breaks (empty: it keeps them all)."""
    prompt, cached, computed = (
        record["prompt_tokens"], record["cached_tokens"], record["computed_tokens"]
    )  # fmt: skip
    recomputed = record.get("recomputed_tokens", 0)
    tier_cached = record.get("tier_cached_tokens", 0)
    where = f"{record.get('stack', '?')}: {record.get('session_id', '?')} call {record['index']}"
    broken = []
    if prompt != cached + computed - recomputed:
        broken.append(
            f"{where}: prompt {prompt} != cached {cached} + computed {computed} "
            f"- recomputed {recomputed}"
        )
    if not 0 <= tier_cached <= cached or not 0 <= recomputed <= computed:
        broken.append(
            f"{where}: cached {cached} from a tier {tier_cached}, computed {computed} "
            f"recomputed {recomputed}: a part exceeds its whole"
        )
    if sum(causes.values()) != computed or any(n < 0 for n in causes.values()):
        broken.append(f"{where}: computed {computed} but its causes are {dict(causes)}")
    return broken


def session_ledger(
    records: list[dict], *, block_size: int, prefix_caching: bool, tiers: bool = False
) -> dict:
    """One stack's ledger for one session (records in call order)."""
    causes, broken = session_causes(
        records, block_size=block_size, prefix_caching=prefix_caching, tiers=tiers
    )
    totals = _sum(records)
    totals["miss_causes"] = dict(sorted(causes.items()))
    totals["invariant_violations"] = broken
    return totals


def session_causes(
    records: list[dict], *, block_size: int, prefix_caching: bool, tiers: bool = False
) -> tuple[Counter[str], list[str]]:
    """(the session's computed tokens by cause, the invariants its calls break)."""
    causes: Counter[str] = Counter()
    broken: list[str] = []
    first_evictions = records[0]["evictions_before"] if records else 0
    earlier_replicas: set[str] = set()
    for record in records:
        replica = record.get("replica")  # set on routed stacks only
        call_causes = attribute_call(
            record,
            block_size=block_size,
            prefix_caching=prefix_caching,
            # Up to the call's end: a session beside it may evict while it waits.
            session_evictions=record.get("evictions_after", record["evictions_before"])
            - first_evictions,
            routed_elsewhere=bool(earlier_replicas - {replica}),
            tiers=tiers,
        )
        broken += check_call(record, call_causes)
        causes.update(call_causes)
        if replica is not None:
            earlier_replicas.add(replica)
    return causes, broken


def paid_twice(causes: dict[str, int]) -> int:
    """Prompt tokens computed again: every cause of paying twice, summed."""
    return sum(causes.get(cause, 0) for cause in PAID_TWICE)


SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _sum(records: Iterable[dict]) -> dict:
    records = list(records)
    keys = (
        "bytes_sent",
        "bytes_received",
        "bytes_new",
        "tokens_tokenized",
        "prompt_tokens",
        "cached_tokens",
        "computed_tokens",
        "output_tokens",
        "ideal_cached",
    )
    counts = {key: int(sum(r[key] for r in records)) for key in keys}
    for key in ("recomputed_tokens", "tier_cached_tokens"):  # older records lack them
        counts[key] = int(sum(r.get(key, 0) for r in records))
    totals: dict[str, int | float | None] = dict(counts)
    totals["tokens_new"] = counts["prompt_tokens"] - counts["ideal_cached"]
    totals["calls"] = len(records)
    totals["incremental_calls"] = sum(1 for r in records if r["incremental"])
    totals["prefix_breaks"] = sum(1 for r in records if r["break_cause"] is not None)
    totals["prompts_not_canonical"] = sum(1 for r in records if not r["prompt_matches_plan"])
    totals["outputs_not_as_recorded"] = sum(1 for r in records if not r["output_matches_recording"])
    totals["wall_s"] = round(sum(r["wall_s"] for r in records), 3)
    totals["ttft_p50_s"] = _percentile([r["ttft_s"] for r in records], 50)
    totals["ttft_p95_s"] = _percentile([r["ttft_s"] for r in records], 95)
    # Speculative decoding, as vLLM counts it: mean acceptance length = 1 + accepted /
    # verifications (records from before speculation was replayed carry none).
    for key in SPEC_KEYS:
        totals[key] = counts[key] = int(sum(r.get(key, 0) for r in records))
    drafts = counts["num_drafts"]
    totals["mean_acceptance_length"] = (
        round(1 + counts["num_accepted_tokens"] / drafts, 4) if drafts else None
    )
    return totals


def merge(ledgers: Iterable[dict], records: Iterable[dict]) -> dict:
    """Totals over several session ledgers; percentiles from the calls themselves."""
    ledgers, records = list(ledgers), list(records)
    merged = _sum(records)
    causes: Counter[str] = Counter()
    for ledger in ledgers:
        causes.update(ledger["miss_causes"])
    merged["miss_causes"] = dict(sorted(causes.items()))
    merged["invariant_violations"] = [v for x in ledgers for v in x["invariant_violations"]]
    merged["sessions"] = len(ledgers)
    return merged


def compare(once: dict, naive: dict) -> dict:
    """The headline ratios of one group of sessions (a source folder, or all)."""
    prompt = naive["prompt_tokens"]
    return {
        "computed_ratio": _ratio(once["computed_tokens"], naive["computed_tokens"]),
        "ideal_ratio": _ratio(naive["tokens_new"], prompt),
        "bytes_ratio": _ratio(once["bytes_received"], naive["bytes_received"]),
        "tokenized_ratio": _ratio(once["tokens_tokenized"], naive["tokens_tokenized"]),
        "wall_ratio": _ratio(once["wall_s"], naive["wall_s"]),
    }


_Row = TypeVar("_Row")


def by_group(rows: Iterable[_Row], key: Callable[[_Row], str]) -> dict[str, list[_Row]]:
    groups: dict[str, list[_Row]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return dict(groups)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None
