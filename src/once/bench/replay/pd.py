"""`once replay --pd P:D`: the once stack over P prefill and D decode engine processes,
beside the same stack colocated over P + D engines, in the same run.

    once/colocated   P + D `once engine` processes, each doing both phases, the once policy
    once/pd          P `--role prefill` and D `--role decode` processes; the router splits
                     by its split policy: `--pd-min-uncached-tokens`, `min_decoding` 0 and a
                     TTFT budget of 1 s (sessions run one at a time here, so a decode
                     replica is rarely busy and the tiny model's prefills are short: the
                     replay exercises the path on every long call rather than choosing)
    once/pd+shared-kv  with `--pd-shared-kv`: once/pd with a shared KV tier (a Redis of the
                     run's own) under every engine, so a prefill engine loads the session
                     prefix a decode engine computed instead of recomputing it (the split
                     rule counts that prefix as fetched: `prefix_from_decode`)

The `pd` section gives, per variant, client TTFT and the inter-token latency the gateway
saw (ForcedOutputEngine.token_gaps_s) as percentiles, and for once/pd: the router's split
decisions, what the decode engines loaded from the prefill engines (blocks, bytes, time),
the largest prompt part a decode engine computed for a split request (the bar: <= 1
token), what the prefill engines computed (their prefix misses included), and the
transfer's throughput against the rate at which the prefill engines made KV (prefill
tokens per second of their step time, times the KV bytes per token; the bar: >= 10x).
The throughput is given twice: in the run (the decode engines' loader time, which shares
two cores with both engines and the gateway), and by a probe of the transport alone
right after it (blocks of the run's size written to a store and read back through a peer,
checked and copied into tensors as the engine does; median of 3 rounds). Outputs are the
recorded ones forced, so "identical outputs" means every call of both variants ran to its
recorded output; token identity of a split against a colocated run, greedy, is the
engine's own test (tests/engine/test_kv_disagg.py).

On this 2-core machine both roles share the cores with the gateway and each other, so the
live latency figures say how the path behaves, not what disaggregation buys at scale: the
simulator carries that claim (`once sim --pd`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from once.bench.replay.routing import StackRun, percentile
from once.bench.replay.stacks import ONCE
from once.engine.kv.block_codec import decode_block, encode_block
from once.engine.kv.disagg.peers import open_peer
from once.engine.kv.disagg.transfer import TransferStore
from once.router.disagg.split import SplitPolicy

COLOCATED = "once/colocated"
DISAGGREGATED = "once/pd"
SHARED_KV = "once/pd+shared-kv"
MIN_TRANSFER_RATIO = 10.0  # the bar: transfer throughput / KV production rate


def add_pd_arguments(parser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation (--pd)")
    group.add_argument(
        "--pd", help="P:D, e.g. 1:1: also replay once over P prefill and D decode engines, "
        f"and colocated over P + D ({COLOCATED}, {DISAGGREGATED})",
    )  # fmt: skip
    group.add_argument("--pd-min-uncached-tokens", type=int, default=256,
                       help="split prompts with at least this many uncached tokens")  # fmt: skip
    group.add_argument("--pd-transport", choices=("shm", "tcp"), default="shm")
    group.add_argument("--pd-shared-kv", action="store_true",
                       help=f"also {SHARED_KV}: {DISAGGREGATED} with a shared KV tier (Redis) "
                       "under every engine, where a prefill engine finds the prefix a decode "
                       "engine computed")  # fmt: skip


def parse_pd(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    prefill, sep, decode = text.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or "0" in (prefill, decode):
        raise ValueError(f"--pd wants P:D with P, D >= 1, e.g. 1:1; got {text!r}")
    return int(prefill), int(decode)


def check_pd_args(args) -> str | None:
    try:
        pd = parse_pd(getattr(args, "pd", None))
    except ValueError as exc:
        return str(exc)
    if pd is None:
        return "--pd-shared-kv needs --pd P:D" if getattr(args, "pd_shared_kv", False) else None
    if args.pd_min_uncached_tokens < 1:
        return "--pd-min-uncached-tokens must be >= 1"
    if getattr(args, "replicas", 1) > 1:
        return "--pd sets its own replicas; leave --replicas out"
    return None


def pd_runs(args, threads: int) -> list[StackRun]:
    pd = parse_pd(getattr(args, "pd", None))
    if pd is None:
        return []
    fleet = {"replicas": sum(pd), "policy": "once", "replica_threads": threads}
    split = SplitPolicy(
        min_uncached_tokens=args.pd_min_uncached_tokens, min_decoding=0, ttft_budget_s=1.0
    )
    pd_options = {**fleet, "pd": pd, "pd_split": split, "pd_transport": args.pd_transport}
    runs = [
        StackRun(replace(ONCE, name=COLOCATED), fleet),
        StackRun(replace(ONCE, name=DISAGGREGATED), pd_options),
    ]
    if getattr(args, "pd_shared_kv", False):
        shared_split = replace(split, prefix_from_decode=True)
        shared_options = {**pd_options, "pd_split": shared_split, "pd_shared_kv": True}
        runs.append(StackRun(replace(ONCE, name=SHARED_KV), shared_options))
    return runs


async def pd_observations(stack) -> dict:
    """What the section needs from a variant's stack, read before it closes."""
    router_stats = await stack.fleet.router.stats()
    pd = stack.fleet.router.pd
    split_ids = set(pd.split_request_ids) if pd is not None else set()
    split_computed = [
        record.metrics.num_computed_tokens
        for record in stack.forced.records
        if record.request_id in split_ids and record.metrics is not None
    ]
    engines = (await stack.fleet.engine_stats())["replicas"]
    return {
        "token_gaps_s": list(stack.forced.token_gaps_s),
        "router_pd": router_stats.get("pd"),
        "split_computed_tokens": split_computed,
        "engines": engines,
    }


def pd_section(records: dict, observed: dict, pd_text: str, transport: str) -> dict:
    section: dict = {"pd": pd_text, "transport": transport, "variants": {}}
    names = [name for name in (COLOCATED, DISAGGREGATED, SHARED_KV) if name in observed]
    for name in names:
        rows = [row for rows in records[name].values() for row in rows]
        gaps = observed[name]["token_gaps_s"]
        section["variants"][name] = {
            "calls": len(rows),
            "ttft_p50_s": percentile([r["ttft_s"] for r in rows], 50),
            "ttft_p90_s": percentile([r["ttft_s"] for r in rows], 90),
            "itl_p50_s": percentile(gaps, 50),
            "itl_p90_s": percentile(gaps, 90),
            "itl_p99_s": percentile(gaps, 99),
            "computed_tokens": sum(r["computed_tokens"] for r in rows),
            "outputs_as_recorded": all(r["output_matches_recording"] for r in rows),
        }
    section["outputs_identical"] = all(
        v["outputs_as_recorded"] for v in section["variants"].values()
    )
    section.update(_split_figures(observed[DISAGGREGATED]))
    computed = observed[DISAGGREGATED]["split_computed_tokens"]
    if section.get("kv_bytes_per_token"):
        block_bytes = int(section["kv_bytes_per_token"] * section["block_size"])
        probe = probe_transport(block_bytes, transport)
        section["probe_gb_per_s"] = probe
        section["probe_vs_kv_rate"] = round(probe * 1e9 / section["kv_production_bytes_per_s"], 2)
    if SHARED_KV in observed:
        shared = _split_figures(observed[SHARED_KV])
        shared["prefill_computed_vs_without"] = round(
            shared["prefill_computed_tokens"] / max(1, section["prefill_computed_tokens"]), 3
        )
        section["shared_kv"] = shared
        computed = computed + observed[SHARED_KV]["split_computed_tokens"]
    section["bar"] = {
        "decode_computes_at_most_one_token": bool(computed) and max(computed) <= 1,
        "transfer_at_least_10x_kv_rate": _at_least(section.get("transfer_vs_kv_rate")),
        "probe_at_least_10x_kv_rate": _at_least(section.get("probe_vs_kv_rate")),
        "outputs_identical": section["outputs_identical"],
    }
    return section


def _split_figures(observed: dict) -> dict:
    """A disaggregated variant's split calls and what its engines moved and computed."""
    computed = observed["split_computed_tokens"]
    return {
        "router": observed["router_pd"],
        "num_split_calls": len(computed),
        "max_decode_computed_tokens_of_split": max(computed) if computed else None,
        **_transfer_figures(observed["engines"]),
    }


def _transfer_figures(engines: dict) -> dict:
    prefill = [s for s in engines.values() if s.get("role") == "prefill"]
    decode = [s for s in engines.values() if s.get("role") == "decode"]
    loaded = sum(s.get("kv_tier_transfer_loaded_bytes", 0) for s in decode)
    load_s = sum(s.get("kv_tier_transfer_load_time_s", 0.0) for s in decode)
    blocks = sum(s.get("kv_tier_transfer_hit_blocks", 0) for s in decode)
    computed = sum(s.get("num_computed_prompt_tokens", 0) for s in prefill)
    step_s = sum(s.get("step_time_s_total", 0.0) for s in prefill)
    block_size = next((s.get("block_size") for s in prefill if s.get("block_size")), None)
    figures: dict = {
        "block_size": block_size,
        "transfer_blocks": int(blocks),
        "transfer_bytes": int(loaded),
        "transfer_time_s": round(load_s, 4),
        "transfer_gb_per_s": round(loaded / load_s / 1e9, 3) if load_s else None,
        "prefill_tokens_per_s": round(computed / step_s, 1) if step_s else None,
        # What the prefill engines computed, their prefix misses included: the decode
        # side's uncached prompt (router.num_uncached_split_tokens) is the least it can be.
        "prefill_computed_tokens": int(computed),
    }
    if any("kv_tier_shared_errors" in stats for stats in engines.values()):  # --pd-shared-kv
        # Blocks every engine wrote to the shared tier, the prefix blocks the prefill
        # engines loaded from it instead of recomputing them, and those the decode engines
        # found there rather than in a prefill engine's store.
        figures["shared_saved_blocks"] = int(
            sum(s.get("kv_tier_shared_saved_blocks", 0) for s in engines.values())
        )
        for role, group in (("prefill", prefill), ("decode", decode)):
            figures[f"{role}_shared_hit_blocks"] = int(
                sum(s.get("kv_tier_shared_hit_blocks", 0) for s in group)
            )
    if blocks and block_size and step_s and load_s:
        bytes_per_token = loaded / blocks / block_size
        kv_rate = computed / step_s * bytes_per_token
        figures["kv_bytes_per_token"] = round(bytes_per_token, 1)
        figures["kv_production_bytes_per_s"] = round(kv_rate)
        figures["transfer_vs_kv_rate"] = round(loaded / load_s / kv_rate, 2)
    return figures


def probe_transport(block_bytes: int, transport: str, num_blocks: int = 64) -> float:
    """GB/s of the transport alone: write, then read back, check and copy num_blocks."""
    fingerprint = b"probe".ljust(16, b"\0")
    half = torch.randn(max(1, block_bytes // 8))  # K or V: fp32, half the block
    out_k, out_v = torch.empty_like(half), torch.empty_like(half)
    store = TransferStore(num_blocks)
    try:
        if transport == "tcp":
            store.serve_tcp()
        for block_hash in range(num_blocks):
            store.put(block_hash, encode_block(fingerprint, block_hash, half, half))
        peer = open_peer(store.address)
        rounds = []
        for _ in range(3):
            started = time.perf_counter()
            for block_hash in range(num_blocks):
                data = peer.get(block_hash)
                if not decode_block(data, fingerprint, block_hash, out_k, out_v):
                    raise RuntimeError("the transport probe read back a bad block")
            rounds.append(time.perf_counter() - started)
        peer.close()
    finally:
        store.close()
    num_bytes = num_blocks * 2 * half.numel() * half.element_size()
    return round(num_bytes / float(np.median(rounds)) / 1e9, 3)


def _at_least(ratio: float | None) -> bool | None:
    return None if ratio is None else ratio >= MIN_TRANSFER_RATIO


def format_pd_section(section: dict) -> str:
    lines = [f"prefill/decode {section['pd']} against colocated over the same engines:"]
    for name, row in section["variants"].items():
        lines.append(
            f"  {name:<15} TTFT p50 {row['ttft_p50_s']} s, p90 {row['ttft_p90_s']} s; ITL p50 "
            f"{row['itl_p50_s']} s, p99 {row['itl_p99_s']} s; computed {row['computed_tokens']}"
        )
    lines.append(
        f"  {section['num_split_calls']} calls split, the decode side computed at most "
        f"{section['max_decode_computed_tokens_of_split']} prompt tokens of one; transfer "
        f"{section['transfer_bytes']} bytes in {section['transfer_time_s']} s = "
        f"{section['transfer_gb_per_s']} GB/s in the run, {section.get('probe_gb_per_s')} "
        f"GB/s alone: {section.get('transfer_vs_kv_rate')}x and "
        f"{section.get('probe_vs_kv_rate')}x the KV the prefill engines made; outputs "
        f"identical: {section['outputs_identical']}; "
        f"bar {section['bar']}"
    )
    shared = section.get("shared_kv")
    if shared:
        lines.append(
            f"  with a shared KV tier: the prefill engines computed "
            f"{shared['prefill_computed_tokens']} prompt tokens "
            f"({shared['prefill_computed_vs_without']}x without), loading "
            f"{shared['prefill_shared_hit_blocks']} prefix blocks from it"
        )
    return "\n".join(lines)


def disaggregated_work(section: dict) -> dict[str, tuple[int, int]]:
    """Each disaggregated variant's (decode engines' computed tokens, prefill engines')."""
    work = {}
    for name, prefill in (
        (DISAGGREGATED, section.get("prefill_computed_tokens")),
        (SHARED_KV, section.get("shared_kv", {}).get("prefill_computed_tokens")),
    ):
        if name in section["variants"] and prefill is not None:
            work[name] = (section["variants"][name]["computed_tokens"], prefill)
    return work
