"""The named baseline of the second bar: transformers with manual prefix reuse.

What a careful user of transformers would do for an agent session without a serving
engine: keep the previous call's KV (a `DynamicCache`), and for each call

    cached:  [ previous prompt ............ | previous output[:-1] ]
    prompt:  [ shared prefix ........ | new suffix ........................ ]
                                      ^ keep = common prefix (at most len(prompt) - 1)

crop the cache to the longest common prefix of its tokens and the new prompt, prefill
only the suffix (in chunks, so SDPA never builds a huge score matrix), then decode the
forced output one token per forward, as generate would (the last output token is never
fed back, so its KV does not exist; the once engine has the same rule). fp32, SDPA, the
model's own DynamicCache: the transformers setup of `engine_bench/hf_baseline.py`.

Times per call: prefill (crop + suffix forwards, up to the first token's logits) and
decode (the forced steps); wall is their sum over the session, model load excluded.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from once.bench.engine_bench.hf_baseline import PREFILL_CHUNK, _forward_with_cache

if TYPE_CHECKING:  # transformers is imported where the model is loaded
    from transformers import Cache

BASELINE_NAME = "transformers_prefix_reuse"


@dataclass
class BaselineCall:
    index: int
    prompt_tokens: int
    reused_tokens: int  # served from the kept KV
    computed_tokens: int  # prefilled
    decode_steps: int
    prefill_s: float  # crop + suffix prefill, up to the first output token's logits
    decode_s: float


class PrefixReuseBaseline:
    """One conversation's KV kept across calls; `run_call` is one model call."""

    def __init__(self, model, prefill_chunk: int = PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, not {prefill_chunk}")
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.cache: Cache | None = None
        self.cached_ids: list[int] = []  # the tokens whose KV the cache holds, in order

    def reset(self) -> None:
        self.cache, self.cached_ids = None, []

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Logits of the prompt's last token (vocab,), and how many tokens were reused."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        keep = min(_common_prefix(self.cached_ids, prompt_ids), len(prompt_ids) - 1)
        if self.cache is not None and keep < len(self.cached_ids):
            self.cache.crop(keep - len(self.cached_ids))  # negative: tokens to remove
        self.cached_ids = self.cached_ids[:keep]
        suffix = torch.tensor([prompt_ids[keep:]], dtype=torch.long)  # (1, T_new)
        logits = None
        for start in range(0, suffix.shape[1], self.prefill_chunk):
            chunk = suffix[:, start : start + self.prefill_chunk]
            logits, self.cache = _forward_with_cache(
                self.model, chunk, self.cache, logits_to_keep=1
            )
        self.cached_ids = list(prompt_ids)
        assert logits is not None  # the suffix has at least one token
        return logits[0, -1], keep

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        """Feed one output token; the logits of the next (vocab,)."""
        ids = torch.tensor([[token_id]], dtype=torch.long)  # (1, 1)
        logits, self.cache = _forward_with_cache(self.model, ids, self.cache)
        self.cached_ids.append(token_id)
        return logits[0, -1]

    def run_call(self, index: int, prompt_ids: list[int], forced_ids: list[int]) -> BaselineCall:
        if not forced_ids:
            raise ValueError(f"call {index}: no output to force")
        started = time.perf_counter()
        _, reused = self.prefill(prompt_ids)
        prefilled = time.perf_counter()
        for token_id in forced_ids[:-1]:
            self.decode(token_id)
        decoded = time.perf_counter()
        if self.cache is None or self.cache.get_seq_length() != len(self.cached_ids):
            raise RuntimeError("transformers' cache length drifted from the tokens it holds")
        return BaselineCall(
            index=index,
            prompt_tokens=len(prompt_ids),
            reused_tokens=reused,
            computed_tokens=len(prompt_ids) - reused,
            decode_steps=len(forced_ids) - 1,
            prefill_s=prefilled - started,
            decode_s=decoded - prefilled,
        )


def run_transformers_baseline(model_folder, plans, log=None) -> dict:
    """Load the served model's folder into transformers (fp32, SDPA) and run the plans."""
    from once.bench.engine_bench.hf_baseline import load_model

    model = load_model(model_folder, torch.get_num_threads())
    return run_baseline(model, plans, log)


def run_baseline(model, plans, log=None) -> dict:
    """Every planned session through the baseline, one session after another."""
    sessions = {}
    for plan in plans:
        runner = PrefixReuseBaseline(model)
        calls = []
        for call in plan.calls:
            calls.append(runner.run_call(call.index, call.prompt_ids, call.forced_ids))
            if log is not None:
                last = calls[-1]
                log(
                    f"transformers {plan.session_id} call {call.index}: prompt "
                    f"{last.prompt_tokens} (reused {last.reused_tokens}), prefill "
                    f"{last.prefill_s:.2f} s, {last.decode_steps} steps {last.decode_s:.2f} s"
                )
        sessions[plan.session_id] = [asdict(c) for c in calls]
    return {"name": BASELINE_NAME, "sessions": sessions, **_totals(sessions)}


def _totals(sessions: dict[str, list[dict]]) -> dict:
    calls = [c for rows in sessions.values() for c in rows]
    prefill = sum(c["prefill_s"] for c in calls)
    decode = sum(c["decode_s"] for c in calls)
    steps = sum(c["decode_steps"] for c in calls)
    return {
        "prefill_s": round(prefill, 3),
        "decode_s": round(decode, 3),
        "wall_s": round(prefill + decode, 3),
        "computed_tokens": sum(c["computed_tokens"] for c in calls),
        "reused_tokens": sum(c["reused_tokens"] for c in calls),
        "decode_steps": steps,
        "decode_step_ms": round(1000 * decode / steps, 2) if steps else None,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def second_bar(records: dict[str, dict[str, list[dict]]], baseline: dict | None) -> dict:
    """The figures of the second bar from the stacks' call records (and the baseline's).

    prefill_s of a stack: the sum over its calls of the engine's TTFT (`RequestMetrics.
    ttft_s`: the request's arrival at the engine to its first output token). Calls run one
    at a time, so that is the time of the steps that prefill the prompt, plus one sampling.
    wall_s of a stack: the sum over calls of the client's send -> response completed
    (transport, gateway and engine). The baseline's wall is its prefill + decode time.
    """
    figures: dict = {"prefill_s": {}, "wall_s": {}}
    for stack, sessions in records.items():
        rows = [row for session_rows in sessions.values() for row in session_rows]
        figures["prefill_s"][stack] = round(sum(row["engine_ttft_s"] for row in rows), 3)
        figures["wall_s"][stack] = round(sum(row["wall_s"] for row in rows), 3)
    once_prefill = figures["prefill_s"].get("once")
    naive_prefill = figures["prefill_s"].get("naive")
    if once_prefill and naive_prefill is not None:
        figures["prefill_ratio"] = round(naive_prefill / once_prefill, 3)
    if baseline is not None:
        figures["baseline"] = baseline
        once_wall = figures["wall_s"].get("once")
        if once_wall is not None and baseline["wall_s"]:
            figures["wall_ratio_vs_transformers_reuse"] = round(once_wall / baseline["wall_s"], 4)
    return figures


def print_second_bar(report: dict, out) -> None:
    prefill, wall = report.get("prefill_s") or {}, report.get("wall_s") or {}
    if not prefill:
        return
    print(
        f"engine prefill: once {prefill.get('once')} s, naive {prefill.get('naive')} s, "
        f"prefill_ratio (naive / once) {report.get('prefill_ratio')}",
        file=out,
    )
    baseline = report.get("baseline")
    if baseline:
        print(
            f"transformers with prefix reuse: wall {baseline['wall_s']} s (prefill "
            f"{baseline['prefill_s']} s, decode {baseline['decode_s']} s, "
            f"{baseline['decode_step_ms']} ms/step); once wall {wall.get('once')} s; "
            f"wall_ratio_vs_transformers_reuse {report.get('wall_ratio_vs_transformers_reuse')}",
            file=out,
        )
