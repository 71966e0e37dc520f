"""Gateway overhead: the same load through the gateway and through the bare engine server.

Both servers wrap the same scripted engine at zero latency and run in their own process;
the load client runs in a third. Two figures:

- the time the gateway adds, as its pipeline measures it per response (admission, prepare,
  the work per event batch and the writes; pipeline.py), read from the gateway's
  `once_gateway_added_seconds` histogram after the run: a sum of durations, never below 0;
- the end-to-end comparison: the gateway's latency minus the engine server's at the same
  percentile. A difference of two percentiles of two separate runs, it swings with load
  and can go negative; it is kept beside the first as the client's view.

The gateway's CPU per call is its process CPU time over the run divided by the calls.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, url: str, what: str, verify=True) -> None:
    """Poll /healthz until it answers 200; fail with the server's stderr if it exits."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/healthz", verify=verify, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stderr = server.stderr.read() if server.stderr is not None else b""
            raise RuntimeError(f"{what} did not start: {stderr!r}")
        time.sleep(0.2)


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def measure(
    mode: str, concurrency: int, calls: int, think_ms: float, timeout_s: float = 300
) -> dict:
    port = free_port()
    module = "once.bench.gateway_bench"
    server = subprocess.Popen(
        [sys.executable, "-m", f"{module}.scripted_server", "--mode", mode, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url, f"{mode} server")
        cpu_before = process_cpu_s(server.pid)
        client = subprocess.run(
            [sys.executable, "-m", f"{module}.load_client", "--mode", mode, "--url", url,
             "--concurrency", str(concurrency), "--calls", str(calls),
             "--think-ms", str(think_ms)],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        )  # fmt: skip
        cpu_s = process_cpu_s(server.pid) - cpu_before
        added_buckets = scrape_histogram(url, ADDED_HISTOGRAM) if mode == "gateway" else {}
    finally:
        server.terminate()
        server.wait(10)
    result = json.loads(client.stdout.strip().splitlines()[-1])
    result["cpu_s"] = cpu_s
    result["added_buckets"] = added_buckets
    return result


ADDED_HISTOGRAM = "once_gateway_added_seconds"


def scrape_histogram(url: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts from a /metrics page: {upper bound: count}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                buckets[float(sample.labels["le"])] = sample.value
    return buckets


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The q-quantile of cumulative buckets, linear within the bucket it falls in (as
    Prometheus's histogram_quantile); the last finite bound when it falls in +Inf."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total == 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def summarize(mode: str, runs: list[dict]) -> dict:
    latencies = [x for run in runs for x in run["latencies_s"]]
    errors = sum(run["errors"] for run in runs)
    return {
        "mode": mode,
        "calls": len(latencies),
        "errors": errors,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "mean_ms": 1000 * statistics.fmean(latencies),
        "server_cpu_ms_per_call": 1000
        * sum(run["cpu_s"] for run in runs)
        / max(1, len(latencies) + errors),
        "calls_per_s": len(latencies) / sum(run["wall_s"] for run in runs),
    }


def run(concurrency: int = 16, calls: int = 20, think_ms: float = 0.0, rounds: int = 3) -> dict:
    """Engine server and gateway measured alternately, `rounds` times each, pooled."""
    runs: dict[str, list[dict]] = {"engine": [], "gateway": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(measure(mode, concurrency, calls, think_ms))
    engine = summarize("engine", runs["engine"])
    gateway = summarize("gateway", runs["gateway"])
    added: dict[float, float] = {}
    for measured in runs["gateway"]:
        for bound, count in measured["added_buckets"].items():
            added[bound] = added.get(bound, 0.0) + count
    return {
        "added_ms_p50": 1000 * histogram_quantile(added, 0.50),
        "added_ms_p99": 1000 * histogram_quantile(added, 0.99),
        "added_responses": added.get(float("inf"), 0.0),
        "concurrency": concurrency,
        "think_ms": think_ms,
        "rounds": rounds,
        "engine_server": engine,
        "gateway": gateway,
        "overhead_ms_p50": gateway["p50_ms"] - engine["p50_ms"],
        "overhead_ms_p99": gateway["p99_ms"] - engine["p99_ms"],
        "gateway_cpu_ms_per_call": gateway["server_cpu_ms_per_call"],
        "errors": engine["errors"] + gateway["errors"],
    }
