"""Speculation on vs off, same engine, same run.

One engine serves every pass; speculation is switched by swapping its drafter (a fresh
one per pass, so no pass learns from an earlier pass's outputs). The calls go in groups
of `--batch`, and every variant below runs on a group before the next group starts: the
group's prompts are prefilled once and every later variant hits the prefix cache (a KV
cache cannot hold all 200 prompts of 4,000 tokens, so pass-major order would prefill
them again for every variant). Timing counts only decode-only steps (no prompt token
prefilled), so prefill never enters decode tokens/s; the figures are sums over groups.

  1. batch 1, forced outputs: no speculation, then each drafter -> tokens per target
     forward (all decode steps; a step without a draft counts as 1) and decode tok/s;
  2. batch 8, forced outputs: no speculation and each drafter; the bar reads the drafter
     that was best at batch 1;
  3. free greedy decoding at batch 8, no speculation vs each drafter: identical ids or not.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from once.bench.spec_bench.ceiling import copy_ceiling
from once.bench.spec_bench.workload import SpecCall, sample_calls
from once.engine.config import EngineConfig
from once.engine.speculative import make_drafter
from once.engine.speculative.governor import DraftLengthGovernor
from once.model_files import DEFAULT_MODEL
from once.protocol.engine import GenerateRequest, SamplingParams

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_spec.json"


def run_pass(engine, calls: list[SpecCall], batch: int, method: str, forced: bool) -> dict:
    """Run calls in groups of `batch`; returns decode tokens/s and speculation counters."""
    engine.drafter = make_drafter(_with_method(engine.config, method), engine.model_config)
    # A fresh governor per pass too: what one drafter's acceptance taught does not carry.
    engine.governor = None
    if method and engine.config.speculative_adaptive:
        engine.governor = DraftLengthGovernor(engine.config.num_speculative_tokens)
    counters_before = engine.stats()
    outputs: dict[str, list[int]] = {}
    decode_s, decode_tokens = 0.0, 0
    for group_start in range(0, len(calls), batch):
        group = calls[group_start : group_start + batch]
        for call in group:
            if forced:
                params = SamplingParams(temperature=0, max_tokens=len(call.output_ids))
            else:
                params = SamplingParams(temperature=0, max_tokens=len(call.output_ids) or 1)
            engine.add_request(
                GenerateRequest(
                    f"{method or 'plain'}-{batch}-{call.call_id}",
                    call.prompt_ids,
                    params,
                    session_key=call.session_key,
                    forced_output_ids=call.output_ids if forced else None,
                )
            )
            outputs[call.call_id] = []
        ids = {f"{method or 'plain'}-{batch}-{c.call_id}": c.call_id for c in group}
        while engine.has_unfinished_requests():
            prefilled = engine.counters["num_computed_prompt_tokens"]
            generated = engine.counters["num_generated_tokens"]
            started = time.perf_counter()
            deltas = engine.step()
            elapsed = time.perf_counter() - started
            new_tokens = engine.counters["num_generated_tokens"] - generated
            if engine.counters["num_computed_prompt_tokens"] == prefilled and new_tokens:
                decode_s += elapsed
                decode_tokens += new_tokens
            for delta in deltas:
                outputs[ids[delta.request_id]].extend(delta.token_ids)
    after = engine.stats()
    delta_of = {k: after[k] - counters_before[k] for k in _SPEC_KEYS}
    forwards = delta_of["num_decode_forwards"]
    engine.drafter = None
    return {
        "method": method or "none",
        "batch": batch,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "tokens_per_forward": delta_of["num_decode_tokens"] / forwards if forwards else 0.0,
        "mean_acceptance_length": (
            1 + delta_of["num_accepted_tokens"] / delta_of["num_drafts"]
            if delta_of["num_drafts"]
            else 1.0
        ),
        **delta_of,
        "outputs": outputs,
    }


_SPEC_KEYS = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_decode_forwards",
    "num_decode_tokens",
)


def _with_method(config: EngineConfig, method: str) -> EngineConfig:
    from dataclasses import replace

    return replace(config, speculative_method=method)


def run_benchmark(args, log) -> dict:
    from once.engine.core import LLMEngine
    from once.engine.loader import resolve_model_path
    from once.model_files import load_tokenizer

    folder = resolve_model_path(args.model)
    tokenizer = load_tokenizer(folder)
    calls = sample_calls(tokenizer, args.num_calls, args.prompt_tokens, args.output_tokens, 0)
    log(f"{len(calls)} calls, prompts cut to {args.prompt_tokens} tokens")
    ceiling = copy_ceiling(calls)
    log("copy-oracle tokens per forward by k: " + _format_ceiling(ceiling))
    if getattr(args, "ceiling_only", False):
        return {"model": str(folder), "num_calls": len(calls), "copy_ceiling": ceiling}
    config = EngineConfig(
        model=str(folder),
        kv_cache_gib=args.kv_cache_gib,
        num_threads=args.num_threads,
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_adaptive=getattr(args, "adaptive", False),
    )
    engine = LLMEngine(config)
    batch, methods = args.batch, list(args.methods)
    variants = (
        [(1, "", True)]
        + [(1, m, True) for m in methods]
        + [(batch, m, True) for m in ["", *methods]]
        + [(batch, m, False) for m in ["", *methods]]
    )
    totals: dict[tuple, dict] = {}
    for group_start in range(0, len(calls), batch):
        group = calls[group_start : group_start + batch]
        for variant in variants:
            _accumulate(totals, variant, run_pass(engine, group, *variant))
        log(f"{group_start + len(group)}/{len(calls)} calls: " + _progress_line(totals, variants))
    passes = [_finish(variant, totals[variant]) for variant in variants]
    result_of = {variant: p for variant, p in zip(variants, passes, strict=True)}
    base_b1 = result_of[(1, "", True)]
    by_method = {m: result_of[(1, m, True)] for m in methods}
    best = max(by_method, key=lambda m: by_method[m]["tokens_per_forward"])
    base_b8, spec_b8 = result_of[(batch, "", True)], result_of[(batch, best, True)]
    plain_out = totals[(batch, "", False)]["outputs"]
    mismatched = sorted(
        {
            call
            for m in methods
            for call, ids in totals[(batch, m, False)]["outputs"].items()
            if plain_out[call] != ids
        }
    )
    return {
        "model": str(folder),
        "num_calls": len(calls),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "adaptive": config.speculative_adaptive,
        "best_method": best,
        "mean_acceptance_length": by_method[best]["tokens_per_forward"],
        "vllm_mean_acceptance_length": by_method[best]["mean_acceptance_length"],
        "speedup_b1": by_method[best]["decode_tok_s"] / base_b1["decode_tok_s"],
        "speedup_b8": spec_b8["decode_tok_s"] / base_b8["decode_tok_s"],
        "identical": not mismatched,
        "mismatched_calls": mismatched,
        "tokens_per_forward_by_method": {m: r["tokens_per_forward"] for m, r in by_method.items()},
        "copy_ceiling": ceiling,
        "speedup_b1_by_method": {
            m: r["decode_tok_s"] / base_b1["decode_tok_s"] for m, r in by_method.items()
        },
        "speedup_b8_by_method": {
            m: result_of[(batch, m, True)]["decode_tok_s"] / base_b8["decode_tok_s"]
            for m in methods
        },
        "passes": passes,
    }


def _format_ceiling(ceiling: dict) -> str:
    return ", ".join(f"{k}: {v:.2f}" for k, v in ceiling.items())


def _accumulate(totals: dict, variant: tuple, result: dict) -> None:
    total = totals.setdefault(variant, {"outputs": {}})
    total["outputs"].update(result.pop("outputs"))
    for key in ("decode_tokens", "decode_s", *_SPEC_KEYS):
        total[key] = total.get(key, 0) + result[key]


def _finish(variant: tuple, total: dict) -> dict:
    """One variant's figures over all groups, in the shape of a single pass."""
    batch, method, forced = variant
    forwards, drafts = total["num_decode_forwards"], total["num_drafts"]
    return {
        "method": method or "none",
        "batch": batch,
        "forced": forced,
        "decode_tokens": total["decode_tokens"],
        "decode_s": total["decode_s"],
        "decode_tok_s": total["decode_tokens"] / total["decode_s"] if total["decode_s"] else 0.0,
        "tokens_per_forward": total["num_decode_tokens"] / forwards if forwards else 0.0,
        "mean_acceptance_length": 1 + total["num_accepted_tokens"] / drafts if drafts else 1.0,
        **{key: total[key] for key in _SPEC_KEYS},
    }


def _progress_line(totals: dict, variants: list[tuple]) -> str:
    parts = []
    for variant in variants:
        if variant[2]:  # forced passes carry the speed figures
            done = _finish(variant, totals[variant])
            name = f"b{variant[0]} {done['method']}"
            parts.append(
                f"{name} {done['decode_tok_s']:.1f} tok/s {done['tokens_per_forward']:.2f}"
            )
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="once bench spec", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-calls", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="the second batch size")
    parser.add_argument("--methods", default="ngram,suffix", help="drafters to compare")
    # 3, not 8: on this CPU each verified row costs compute (about a fifth of a decode step
    # at 4k context), and rows past the third are rarely accepted (8 calls: 0.90x at 8,
    # 1.26x at 3, at batch 1).
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="cost-aware draft length (spec/governor.py), up to --num-speculative-tokens",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument(
        "--ceiling-only",
        action="store_true",
        help="only the copy oracle's tokens per forward (no model run; see ceiling.py)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if args.num_calls < 1 or args.prompt_tokens < 1 or args.output_tokens < 1 or not args.methods:
        print("once bench spec: counts must be >= 1 and a method given", file=sys.stderr)
        return 2
    try:
        results = run_benchmark(args, lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"once bench spec: {exc}", file=sys.stderr)
        return 2
    if args.ceiling_only and args.out == DEFAULT_OUT:  # keep the timed results file intact
        args.out = DEFAULT_OUT.with_name("bench_spec_ceiling.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2)
    args.out.write_text(text + "\n")
    print(f"results written to {args.out}", file=sys.stderr)
    if args.json:
        print(text)
    return 0
