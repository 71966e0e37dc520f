"""`once bench engine --contention`: the engine's throughput beside busy processes.

A serving stack on CPU shares its cores (with its gateway, the user's editor, a CI job);
it should slow down in proportion, never collapse. Per OpenMP wait policy this measures
output tokens/s at concurrency 1 and 8, quiet, then with 1 and with 2 busy processes
beside it (each a CPU-bound loop, started and stopped here), then quiet again:

    contention_ratio_<N>busy = c8 tok/s with N busy / quiet c8 tok/s (quiet: the mean of
                               the runs before and after)
    fair_share_<N>busy       = cores / (cores + N): the engine's share of the machine when
                               the scheduler splits it evenly among runnable threads
    bar                      ratio >= 0.7 x fair share

Each policy runs in a process of its own, since OpenMP reads its wait policy when it
loads: `passive` is what once sets (cpus.py), `spin` is libgomp's own default (spin
~300k iterations, then sleep), the baseline measured in the same run. The load average
is recorded beside every figure: other work on the machine moves them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from once import OPENMP_WAIT_VARS
from once.cpus import usable_cores

BAR_FACTOR = 0.7
BUSY_COUNTS = (1, 2)
POLICIES = {
    # What once sets before torch loads (cpus.py).
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"},
    # libgomp's default: a spin count set explicitly keeps once from choosing (cpus.py).
    "spin": {"GOMP_SPINCOUNT": "300000"},
    # libgomp's own spin when it knows its threads oversubscribe the CPUs: ~20 us here.
    "short-spin": {"GOMP_SPINCOUNT": "1000"},
    # A bounded spin that still covers the gaps between a decode step's parallel regions.
    "spin-5k": {"GOMP_SPINCOUNT": "5000"},
}
DEFAULT_POLICIES = ("passive", "spin")
BUSY_LOOP = "while True: pass  # once bench engine --contention"


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def measure(model: str, num_threads: int, repeats: int, output_tokens: int) -> dict:
    """In this process (its OpenMP policy already fixed): every condition's tok/s."""
    from once.bench.engine_bench import once_side
    from once.bench.engine_bench.workloads import random_prompts
    from once.engine.loader import resolve_model_path

    engine = once_side.make_engine(str(resolve_model_path(model)), num_threads, max_num_seqs=64)
    vocab = engine.model_config.vocab_size
    once_side.warm_up(engine, vocab)
    prompts = {c: random_prompts(c, 128, vocab, f"contention/c{c}") for c in (1, 8)}

    def condition(num_busy: int) -> dict:
        busy = busy_processes(num_busy)
        try:
            time.sleep(0.5)  # the loops are running
            load = os.getloadavg()[0]
            row: dict = {"busy": num_busy, "load_avg_1m": round(load, 2)}
            for c, batch in prompts.items():
                cpu_before = _cpu_s()
                runs = [
                    once_side.measure_throughput(engine, batch, output_tokens)["output_tok_s"]
                    for _ in range(repeats)
                ]
                row[f"c{c}_tok_s"] = round(statistics.median(runs), 2)
                row[f"c{c}_runs"] = [round(r, 2) for r in runs]
                # The engine's own CPU per output token: what spinning at barriers burns.
                cpu_ms = 1000 * (_cpu_s() - cpu_before) / (repeats * c * output_tokens)
                row[f"c{c}_cpu_ms_per_token"] = round(cpu_ms, 2)
            return row
        finally:
            stop(busy)

    rows = [condition(0), *(condition(n) for n in BUSY_COUNTS), condition(0)]
    return {"threads": num_threads, "conditions": rows}


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def summarize(policy_rows: list[dict], cores: int) -> dict:
    quiet = statistics.mean(r["c8_tok_s"] for r in policy_rows if r["busy"] == 0)
    summary: dict = {"quiet_c8_tok_s": round(quiet, 2)}
    for n in BUSY_COUNTS:
        [row] = [r for r in policy_rows if r["busy"] == n]
        ratio = row["c8_tok_s"] / quiet if quiet else None
        fair = cores / (cores + n)
        summary[f"contention_ratio_{n}busy"] = None if ratio is None else round(ratio, 3)
        summary[f"fair_share_{n}busy"] = round(fair, 3)
        summary[f"bar_{n}busy"] = ratio is not None and ratio >= BAR_FACTOR * fair
    return summary


def run(args: argparse.Namespace, log=None) -> dict:
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    cores = usable_cores()
    threads = args.threads or cores
    results: dict = {"benchmark": "engine-contention", "model": args.model, "cores": cores}
    results["threads"] = threads
    results["bar"] = f"contention_ratio_<N>busy >= {BAR_FACTOR} x cores / (cores + N)"
    for policy in args.policies:
        log(f"contention, wait policy {policy} (load {os.getloadavg()[0]:.2f}) ...")
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
        env.update(POLICIES[policy])
        command = [sys.executable, "-m", "once.bench.engine_bench.contention", "--child"]
        command += ["--model", args.model, "--threads", str(threads)]
        command += ["--repeats", str(args.repeats), "--output-tokens", str(args.output_tokens)]
        child = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            raise RuntimeError(f"the {policy} run failed: {child.stderr[-2000:]}")
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        results[policy] = {**measured, **summarize(measured["conditions"], cores)}
    main_policy = results[args.policies[0]]
    for n in BUSY_COUNTS:  # the headline: once's own policy, the first one run
        for key in (f"contention_ratio_{n}busy", f"fair_share_{n}busy", f"bar_{n}busy"):
            results[key] = main_policy[key]
    return results


def render(results: dict) -> str:
    lines = [
        f"once bench engine --contention  model={results['model']}  cores={results['cores']}"
        f"  threads={results['threads']}",
        "policy   busy  load1m  c1 tok/s  c8 tok/s  c8 CPU ms/token",
    ]
    for policy in POLICIES:
        if policy not in results:
            continue
        for row in results[policy]["conditions"]:
            lines.append(
                f"{policy:8} {row['busy']:>4}  {row['load_avg_1m']:>6.2f}  {row['c1_tok_s']:>8.1f}"
                f"  {row['c8_tok_s']:>8.1f}  {row.get('c8_cpu_ms_per_token', 0):>15.1f}"
            )
        summary = results[policy]
        for n in BUSY_COUNTS:
            lines.append(
                f"{policy:8} contention_ratio_{n}busy {summary[f'contention_ratio_{n}busy']}"
                f" (fair share {summary[f'fair_share_{n}busy']}, bar"
                f" {'PASS' if summary[f'bar_{n}busy'] else 'FAIL'})"
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--contention")
    group.add_argument("--contention", action="store_true", help="throughput beside busy loops")
    group.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), default=list(DEFAULT_POLICIES),
        help="OpenMP wait policies to measure, each in its own process (first: headline)",
    )  # fmt: skip
    group.add_argument("--repeats", type=int, default=3, help="runs per condition (median)")


def main_child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="contention --child")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--output-tokens", type=int, required=True)
    args = parser.parse_args(argv)
    measured = measure(args.model, args.threads, args.repeats, args.output_tokens)
    print(json.dumps(measured))
    return 0


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main_child(sys.argv[1:]))
