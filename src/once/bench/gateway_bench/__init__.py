"""`once bench gateway`: the gateway's bars, measured in one run (see README.md).

- overhead: the time the gateway's pipeline adds per response (its own measurement, a sum
  of durations), and the gateway vs the engine's own HTTP server end to end, both around a
  zero-latency scripted engine, 16 concurrent agent streams (a call, then a tool pause of
  25-75 ms, then the next call), the client in its own process; and the same as a closed
  loop with no pause, which saturates the one core the server has (overhead.py);
- incremental tokenization vs full render+tokenize at the last call of every recorded
  session (tokenize.py);
- client bytes, WebSocket incremental vs stateless HTTP, per source folder (payloads.py);
- TTFT added by the input safety check beside prefill (safety_ttft.py);
- the per-call handshake cost a persistent WSS connection removes (tls.py).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_gateway.json"
MODEL = "smollm2-135m-instruct"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_benchmark(args) -> dict:
    from once.bench.gateway_bench import overhead, safety_ttft, tls, tokenize
    from once.bench.payloads import session_payload_bytes
    from once.bench.traces import load_sessions
    from once.engine.loader import resolve_model_path
    from once.gateway.model import ModelRuntime

    started = time.perf_counter()
    results: dict = {"model": MODEL}
    _log(
        f"overhead: {args.concurrency} agent streams x {args.calls} calls, "
        f"{args.think_ms:g} ms tool time between a stream's calls ..."
    )
    results["overhead"] = overhead.run(args.concurrency, args.calls, think_ms=args.think_ms)
    _log("overhead: the same as a closed loop (no tool time: the server saturates) ...")
    results["overhead_closed_loop"] = overhead.run(args.concurrency, args.calls, think_ms=0)
    runtime = ModelRuntime.load(MODEL, resolve_model_path(MODEL), max_model_len=8192)
    _log("incremental tokenization over the recorded sessions ...")
    results["tokenization"] = tokenize.run(runtime, repeats=3)
    _log("client bytes, WebSocket incremental vs stateless HTTP ...")
    per_session = [session_payload_bytes(s) for s in load_sessions()]
    by_source: dict[str, list[float]] = {}
    for row in per_session:
        by_source.setdefault(row["source"], []).append(row["ratio"])
    results["ws_bytes"] = {"sessions": per_session}
    ws_ratio = {source: statistics.median(r) for source, r in sorted(by_source.items())}
    if not args.skip_safety:
        _log("safety check beside prefill ...")
        results["safety"] = safety_ttft.run(runtime)
    if not args.skip_tls:
        _log("TLS: a new HTTPS connection per call vs one WSS connection ...")
        results["tls"] = tls.run()
    over = results["overhead"]
    summary = {
        "added_ms_p50": over["added_ms_p50"],
        "added_ms_p99": over["added_ms_p99"],
        "closed_loop_added_ms_p50": results["overhead_closed_loop"]["added_ms_p50"],
        "closed_loop_added_ms_p99": results["overhead_closed_loop"]["added_ms_p99"],
        "overhead_ms_p50": over["overhead_ms_p50"],
        "overhead_ms_p99": over["overhead_ms_p99"],
        "gateway_ms_p50": over["gateway"]["p50_ms"],
        "gateway_ms_p99": over["gateway"]["p99_ms"],
        "gateway_cpu_ms_per_call": over["gateway_cpu_ms_per_call"],
        "engine_server_cpu_ms_per_call": over["engine_server"]["server_cpu_ms_per_call"],
        "engine_server_ms_p50": over["engine_server"]["p50_ms"],
        "engine_server_ms_p99": over["engine_server"]["p99_ms"],
        "closed_loop_overhead_ms_p50": results["overhead_closed_loop"]["overhead_ms_p50"],
        "closed_loop_overhead_ms_p99": results["overhead_closed_loop"]["overhead_ms_p99"],
        "closed_loop_overhead_ms_mean": results["overhead_closed_loop"]["gateway"]["mean_ms"]
        - results["overhead_closed_loop"]["engine_server"]["mean_ms"],
        "errors": over["errors"] + results["overhead_closed_loop"]["errors"],
        "incremental_tokenize_speedup_median": results["tokenization"][
            "incremental_tokenize_speedup_median"
        ],
        "incremental_ids_identical": results["tokenization"]["incremental_ids_identical"],
        "stateless_incremental_tokenize_speedup_median": results["tokenization"][
            "stateless_incremental_tokenize_speedup_median"
        ],
        "stateless_ids_identical": results["tokenization"]["stateless_ids_identical"],
        "ws_bytes_ratio": ws_ratio,
        "safety_ttft_added_fraction": results.get("safety", {}).get("safety_ttft_added_fraction"),
        "tls_handshake_ms_saved_per_call": results.get("tls", {}).get(
            "handshake_ms_saved_per_call"
        ),
        "wall_s": time.perf_counter() - started,
    }
    return {**summary, "details": results}


def print_report(result: dict) -> None:
    ratio = ", ".join(f"{k} {v:.1f}x" for k, v in result["ws_bytes_ratio"].items())
    lines = [
        "once bench gateway",
        f"  time the gateway adds per response, as its pipeline measures it (16 agent "
        f"streams): p50 {result['added_ms_p50']:.2f} ms, p99 {result['added_ms_p99']:.2f} ms "
        f"(bars <= 5 / <= 25); closed loop p50 {result['closed_loop_added_ms_p50']:.2f} ms, "
        f"p99 {result['closed_loop_added_ms_p99']:.2f} ms",
        f"  end to end, gateway minus engine server (16 agent streams): p50 "
        f"{result['overhead_ms_p50']:+.1f} ms, p99 {result['overhead_ms_p99']:+.1f} ms "
        f"(bars <= 5 / <= 25); gateway p50 {result['gateway_ms_p50']:.1f} ms, engine server "
        f"{result['engine_server_ms_p50']:.1f} ms",
        f"  closed loop (saturated): p50 {result['closed_loop_overhead_ms_p50']:+.1f} ms, "
        f"p99 {result['closed_loop_overhead_ms_p99']:+.1f} ms, mean "
        f"{result['closed_loop_overhead_ms_mean']:+.1f} ms; errors {result['errors']}",
        f"  gateway CPU per call {result['gateway_cpu_ms_per_call']:.2f} ms "
        f"(engine server {result['engine_server_cpu_ms_per_call']:.2f} ms)",
        f"  incremental tokenization speedup, median: "
        f"{result['incremental_tokenize_speedup_median']:.1f}x (bar >= 20); identical ids: "
        f"{result['incremental_ids_identical']}",
        f"  stateless clients (whole conversation resent), median speedup: "
        f"{result['stateless_incremental_tokenize_speedup_median']:.1f}x (bar >= 20); identical "
        f"ids: {result['stateless_ids_identical']}",
        f"  client bytes HTTP / WebSocket, median per source: {ratio} (bar >= 25 mini-swe-agent)",
    ]
    if result["safety_ttft_added_fraction"] is not None:
        lines.append(
            f"  safety TTFT added / check time: {result['safety_ttft_added_fraction']:.3f} "
            "(bar <= 0.10)"
        )
    if result["tls_handshake_ms_saved_per_call"] is not None:
        lines.append(
            f"  HTTPS new connection per call vs one WSS: "
            f"{result['tls_handshake_ms_saved_per_call']:.2f} ms saved per call"
        )
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="once bench gateway", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20, help="calls per stream")
    parser.add_argument(
        "--think-ms", type=float, default=50.0, help="mean tool time between a stream's calls"
    )
    parser.add_argument("--skip-safety", action="store_true")
    parser.add_argument("--skip-tls", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the JSON summary")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = run_benchmark(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "details"}, indent=1))
    else:
        print_report(result)
    _log(f"results written to {args.out}")
    return 0
