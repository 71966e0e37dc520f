"""What every replay checks about its own figures, and what it ran with.

ledger_invariants   every call of every stack against the ledger's invariants
                    (ledger.check_call): a broken one makes `once replay` exit 1
shared_ideal        per source folder and in total, the fewest prompt tokens a cache
                    shared by all sessions could compute (shared_ideal.py), and
                    whether every stack computed at least that (it must)
run_description     the model, its weights and the context cap the figures come from
"""

from __future__ import annotations

from once.bench.replay.ledger import session_causes
from once.bench.replay.shared_ideal import shared_ideal_tokens

MAX_LISTED = 20  # violations listed in the report (all are counted)


def ledger_invariants(
    records: dict[str, dict[str, list[dict]]],
    prefix_caching: dict[str, bool],
    tiers: dict[str, bool],
    block_size: int,
) -> dict:
    broken: list[str] = []
    num_calls = 0
    for name, sessions in records.items():
        for rows in sessions.values():
            num_calls += len(rows)
            _, call_violations = session_causes(
                rows,
                block_size=block_size,
                prefix_caching=prefix_caching.get(name, True),
                tiers=tiers.get(name, False),
            )
            broken += call_violations
    return {
        "holds": not broken,
        "calls_checked": num_calls,
        "num_violations": len(broken),
        "violations": broken[:MAX_LISTED],
    }


def shared_ideal(
    plans, records: dict[str, dict[str, list[dict]]], prefill_elsewhere: tuple[str, ...] = ()
) -> dict:
    """plans: (source folder, SessionPlan) pairs; only the calls every stack ran count.

    `prefill_elsewhere` names stacks whose calls' computed tokens leave out what prefill
    engines computed for them (disaggregated serving): their per-call counts are not held
    to the bound; `check_disaggregated_bound` checks their total with the prefill side's."""
    groups: dict[str, list[tuple[list[int], list[int]]]] = {}
    for folder, plan in plans:
        ran = min(len(sessions.get(plan.session_id, ())) for sessions in records.values())
        groups.setdefault(folder, []).extend(
            (call.prompt_ids, call.forced_ids) for call in plan.calls[:ran]
        )
    bound = shared_ideal_tokens(groups)
    folder_of = {plan.session_id: folder for folder, plan in plans}
    computed: dict[str, dict[str, int]] = {}  # stack -> folder (and "total") -> tokens
    for name, sessions in records.items():
        if name in prefill_elsewhere:
            continue
        per_folder = computed.setdefault(name, {"total": 0})
        for session_id, rows in sessions.items():
            tokens = sum(row["computed_tokens"] for row in rows)
            folder = folder_of.get(session_id, "?")
            per_folder[folder] = per_folder.get(folder, 0) + tokens
            per_folder["total"] += tokens
    beaten = [
        f"{name} computed {tokens} prompt tokens in {folder}, under the bound {bound[folder]}"
        for name, per_folder in computed.items()
        for folder, tokens in per_folder.items()
        if folder in bound and tokens < bound[folder]
    ]
    return {"tokens": bound, "computed": computed, "holds": not beaten, "beaten": beaten}


def check_disaggregated_bound(bound: dict, work: dict[str, tuple[int, int]]) -> None:
    """A disaggregated variant's whole prompt work against the bound's total. `work`: for
    each such stack, (its decode engines' per-call computed tokens, what its prefill
    engines computed)."""
    for name, (decode, prefill) in work.items():
        bound["computed"][name] = {"total": decode + prefill, "of_it_prefill_engines": prefill}
        if decode + prefill < bound["tokens"]["total"]:
            bound["beaten"].append(
                f"{name} computed {decode + prefill} prompt tokens with its prefill engines, "
                f"under the bound {bound['tokens']['total']}"
            )
            bound["holds"] = False


def run_description(args, tiny: str) -> dict:
    """The model, its weights and the context cap: the figures depend on all three."""
    if args.model == tiny:
        weights = "random (tiny Llama, SmolLM2's tokenizer): token counts are the real ones, "
        weights += "wall times and TTFT are not"
    else:
        weights = f"pretrained ({args.model})"
    return {"model": args.model, "weights": weights, "context_cap": args.max_model_len}
