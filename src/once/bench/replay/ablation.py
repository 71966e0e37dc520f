"""Ablation: the once stack with one optimization switched off at a time.

Each variant is replayed on the same sessions in the same run. An optimization's
contribution is what its variant costs beyond the full once stack, per resource, end to
end: bytes the gateway received, tokens it tokenized, prompt tokens the engine computed,
and wall time. Speculation joins the list when the once stack speculates; routing's
contribution is the routing section's (policies compared over the same replicas).
"""

from __future__ import annotations

from once.bench.replay.stacks import ONCE, StackSpec

NO_SPECULATION = "once-no-spec"

# name -> (the stack with that optimization off, what was switched off)
ABLATIONS: dict[str, tuple[StackSpec, str]] = {
    "once-http": (
        StackSpec("once-http", websocket=False, prefix_caching=True),
        "WebSocket incremental requests -> stateless HTTP with the full history",
    ),
    "once-full-render": (
        StackSpec(
            "once-full-render", websocket=True, prefix_caching=True, incremental_tokenization=False
        ),
        "incremental tokenization -> full render and tokenization in the gateway",
    ),
    "once-no-cache": (
        StackSpec("once-no-cache", websocket=True, prefix_caching=False),
        "prefix cache -> off",
    ),
    # Only when the once stack speculates (`once replay --speculative`).
    NO_SPECULATION: (
        StackSpec(NO_SPECULATION, websocket=True, prefix_caching=True),
        "speculative decoding -> off",
    ),
}
RESOURCES = ("bytes_received", "tokens_tokenized", "computed_tokens", "wall_s")


def ablation_table(totals: dict[str, dict]) -> list[dict]:
    """Rows per variant: its totals, and (variant - once) as the optimization's contribution.

    `totals` maps stack name -> merged ledger; it must hold "once" and each variant run.
    """
    base = totals[ONCE.name]
    rows = []
    for name, (_, switched_off) in ABLATIONS.items():
        if name not in totals:
            continue
        variant = totals[name]
        row: dict[str, object] = {"stack": name, "switched_off": switched_off}
        for resource in RESOURCES:
            saved = variant[resource] - base[resource]
            row[resource] = variant[resource]
            row[f"{resource}_saved"] = round(saved, 3) if isinstance(saved, float) else saved
            row[f"{resource}_factor"] = (
                round(variant[resource] / base[resource], 3) if base[resource] else None
            )
        rows.append(row)
    return rows
