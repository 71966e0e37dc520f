"""Gateway overhead: the same load through the gateway and through the bare engine server.

Both servers wrap the same scripted engine at zero latency and run in their own process;
the load client runs in a third. The gateway's added latency at a percentile is its
latency minus the engine server's at that percentile: what rendering, tokenization,
detokenization, events and SSE framing add on top of serving the engine over HTTP. The
gateway's CPU per call is its process CPU time over the run divided by the calls.
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
            raise RuntimeError(f"{what} did not start: {server.stderr.read()!r}")
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
    finally:
        server.terminate()
        server.wait(10)
    result = json.loads(client.stdout.strip().splitlines()[-1])
    result["cpu_s"] = cpu_s
    return result


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
    return {
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
