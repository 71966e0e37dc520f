"""The serving peers of `once bench engine --baseline`: which ones a run measures, the same
workload handed to each, and the greedy-output check between once and a peer.

A peer gets the very token ids once ran (throughput prompts per concurrency, the 128-token
and long-context decode prompts, the session's seeded stream), after once's engines are
freed, so the two never share the cores. Outputs are compared token by token: at equal
precision a greedy decode should agree, and where it does not the report says how far.
"""

import argparse
from pathlib import Path

from once.bench.engine_bench import llama_cpp_side, vllm_side
from once.bench.engine_bench.once_side import SessionShape

BASELINES = ("transformers", "llamacpp", "vllm")
DEFAULT_BASELINES = ("transformers", "llamacpp")  # llama.cpp is skipped until built


def parse_baselines(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in BASELINES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--baseline takes a comma list of {', '.join(BASELINES)}; got {text!r}"
        )
    return names


def output_agreement(once_outputs: list[list[int]], peer_outputs: list[list[int]]) -> dict:
    """How far greedy outputs agree: requests equal end to end, and the mean share of each
    output before the first differing token."""
    if len(once_outputs) != len(peer_outputs) or not once_outputs:
        return {"num_requests": 0, "num_equal": 0, "mean_agreeing_prefix": None}
    shares = []
    pairs = list(zip(once_outputs, peer_outputs, strict=True))
    for ours, theirs in pairs:
        agreeing = 0
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                break
            agreeing += 1
        shares.append(agreeing / max(len(ours), len(theirs), 1))
    return {
        "num_requests": len(once_outputs),
        "num_equal": sum(1 for ours, theirs in pairs if ours == theirs),
        "mean_agreeing_prefix": sum(shares) / len(shares),
    }


def run_vllm(
    folder: Path,
    num_threads: int,
    kv_cache_gib: float,
    max_model_len: int,
    eager: bool,
    workload: dict,
    session: SessionShape | None,
    vocab: int,
    seed: str,
    log,
    dtype: str = "float32",
) -> dict:
    """vLLM's side on `workload` (once's prompts: "throughput" per concurrency, "decode"),
    then the agreement of its greedy outputs with once's (`workload["once_outputs"]`):
    equal where the precision is (fp32), a count of agreeing ones at bf16."""
    spec = vllm_side.server_spec(
        folder, num_threads, int(kv_cache_gib * 1024), max_model_len, eager, dtype
    )
    result = vllm_side.measure(
        spec,
        list(workload["throughput"].values()),
        workload["num_output"],
        workload["decode"],
        workload["decode_steps"],
        session,
        vocab,
        seed,
        log,
    )
    if result.get("status") == "ok":
        check_outputs(result, workload)
    return result


def run_llamacpp(
    folder: Path,
    num_threads: int,
    max_model_len: int,
    workload: dict,
    session: SessionShape | None,
    vocab: int,
    seed: str,
    log,
) -> dict:
    """llama.cpp's rows (f32, q8_0, q4_1) on `workload`, each row's greedy outputs checked
    against once's (equal where the precision is: the f32 row)."""
    result = llama_cpp_side.measure(
        folder, num_threads, max_model_len, workload, session, vocab, seed, log
    )
    for row in (result.get("rows") or {}).values():
        check_outputs(row, workload)
    return result


def check_outputs(peer: dict, workload: dict) -> None:
    """Each concurrency's outputs (popped) -> their agreement with once's on that prompt."""
    for c, row in peer["throughput"].items():
        once_outputs = workload["once_outputs"].get(c)
        peer_outputs = row.pop("outputs", None)
        if once_outputs is not None and peer_outputs is not None:
            row["greedy_agreement"] = output_agreement(once_outputs, peer_outputs)
