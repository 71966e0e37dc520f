"""Fit the CPU profile's cost model to the once engine's own benchmark.

`once bench engine` writes results/bench_engine.json; this fits, by least squares,
  decode step  = step_base + decode_per_seq * batch + decode_per_context_token * context
from its decode-step timings (batch 1/8/32 at 128-token prompts, batch 1 at 8,000 context),
then, with that step base,
  TTFT - step_base * steps = prefill_per_token * n + prefill_attention_per_pair * pairs
from its prefill timings (each turn of the 20-turn cached session, and the 8,000-token
prefill), where steps = ceil(n / token budget). The numbers in profiles.toml for
cpu-once-smollm2 are this fit; rerun it after a new engine benchmark.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

_PROMPT_TOKENS_IN_THROUGHPUT_RUNS = 128


def fit_cpu_profile(bench: dict) -> dict[str, float]:
    once = bench["once"]
    options = bench["options"]
    budget = int(options["max_num_batched_tokens"])
    mean_output = options["output_tokens"] / 2
    rows, times = [], []
    for key, run in once["throughput"].items():
        batch = int(key)
        context = batch * (_PROMPT_TOKENS_IN_THROUGHPUT_RUNS + mean_output)
        rows.append([1.0, batch, context])
        times.append(run["decode_step_ms"] / 1000)
    long_context = once["long_context"]
    rows.append([1.0, 1, long_context["context_tokens"]])
    times.append(long_context["decode_step_ms"] / 1000)
    (step_base, per_seq, per_context), *_ = np.linalg.lstsq(
        np.array(rows), np.array(times), rcond=None
    )

    rows, times = [], []
    for turn in bench["session"]["cached"]["turns"]:
        n, cached = turn["computed_tokens"], turn["cached_tokens"]
        rows.append([n, n * (cached + (n + 1) / 2)])
        times.append(turn["ttft_ms"] / 1000 - step_base * math.ceil(n / budget))
    n = long_context["context_tokens"]
    rows.append([n, n * (n + 1) / 2])
    times.append(long_context["prefill_s"] - step_base * math.ceil(n / budget))
    (per_token, per_pair), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    fitted = {
        "step_base_s": float(step_base),
        "decode_per_seq_s": float(per_seq),
        "decode_per_context_token_s": float(per_context),
        "prefill_per_token_s": float(per_token),
        "prefill_attention_s_per_pair": float(per_pair),
    }
    negative = [name for name, value in fitted.items() if value <= 0]
    if negative:
        raise ValueError(f"the benchmark does not determine {negative}: fitted values <= 0")
    return fitted


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0] if argv else "results/bench_engine.json")
    fitted = fit_cpu_profile(json.loads(path.read_text()))
    for name, value in fitted.items():
        print(f"{name} = {value:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
