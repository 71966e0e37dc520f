"""`once bench agent`: the harness's bars in one run (see README.md).

- tool search over LiveMCPBench + GitHub's MCP tools: recall@5 of the default and the
  hybrid ranker, over all tasks and each part of the fixed tuning/held-out split, exact
  names, and the first request's tool tokens with deferral vs all tools inline
  (search.py);
- Code Mode vs one tool call per model call on real MCP tools over stdio (code_mode.py);
- the cache doctor on the recorded sessions' real prefix breaks and on injected ones
  (doctor.py).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_agent.json"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_benchmark() -> dict:
    from once.bench.agent_bench import code_mode, doctor, search
    from once.gateway.testing import load_runtime

    started = time.perf_counter()
    _log("tool search ...")
    found = search.run()
    _log("cache doctor ...")
    doctored = doctor.run()
    _log("Code Mode vs sequential tool calls ...")
    with tempfile.TemporaryDirectory() as tmp:
        coded = code_mode.run(load_runtime(), Path(tmp))
    summary = {
        "tool_search_recall_at_5": found["tool_search_recall_at_5"],
        "tool_search_recall_at_5_tuning": found["tool_search_recall_at_5_tuning"],
        "tool_search_recall_at_5_heldout": found["tool_search_recall_at_5_heldout"],
        "tool_search_default_ranker": found["tool_search_default_ranker"],
        "hybrid_recall_at_5_tuning": found.get("hybrid_recall_at_5_tuning"),
        "hybrid_recall_at_5_heldout": found.get("hybrid_recall_at_5_heldout"),
        "plain_bm25_recall_at_5": found.get("plain_bm25_recall_at_5"),
        "exact_name_top1": found["exact_name_top1"],
        "deferred_prompt_fraction": found["deferred_prompt_fraction"],
        "code_mode_wall_ratio": coded["code_mode_wall_ratio"],
        "code_mode_context_ratio": coded["code_mode_context_ratio"],
        "code_mode_model_calls": coded["code_mode_model_calls"],
        "sequential_model_calls": coded["sequential_model_calls"],
        "cache_doctor_unexplained_breaks": doctored["cache_doctor_unexplained_breaks"],
        "wall_s": time.perf_counter() - started,
    }
    return {**summary, "details": {"search": found, "code_mode": coded, "doctor": doctored}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="once bench agent", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the JSON summary")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = run_benchmark()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    summary = {k: v for k, v in result.items() if k != "details"}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    _log(f"results written to {args.out}")
    return 0
