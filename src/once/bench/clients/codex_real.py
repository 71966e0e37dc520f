"""`once bench clients --real-codex`: Codex CLI on the real model beside busy processes.

Issue 31's end-to-end bar: `codex exec` with its default configuration (its default
model, which the gateway's aliases map to SmolLM2) plus one MCP server
(`mcp-server-time`), against `once serve` on SmolLM2, over HTTP+SSE and then over
WebSocket (the provider's `supports_websockets`), each beside `--busy` CPU-bound
processes (contention.py's loops, started once the server answers and stopped when Codex
ends). Each mode gets a fresh `once serve`, so each prefills Codex's first prompt (~14k
tokens: its instructions and tool list) cold. That prompt is past SmolLM2's 8,192 trained
positions, so the server runs with a 32k window stretched by YaRN (`--rope-scaling`,
factor 4, as an operator serves a model past its trained context; without it SmolLM2
never ended a reply there) and caps replies that set no budget (Codex sets none) at 256 tokens
(`default_max_output_tokens`, an operator's setting, in the server's config file;
`--max-output-tokens` changes it). A reply cut there ends `incomplete`, as OpenAI's API
ends it, and Codex prints that as an error ("Incomplete response returned, reason:
max_output_tokens": it accepts only `interrupted` as a reason), so a model that never
says eos fails this bar whatever the transport does.

No timeout of Codex's is raised: its stream idle timer (300 s) stays as shipped, and the
gateway's keep-alives (keep_alive.py, every 10 s) are what must keep it from expiring
while a busy machine prefills. The only bound here is a hang guard on the whole `codex
exec` (`hang_guard_s`, an hour by default), reported as such when it fires.

Per mode: Codex's exit status, every line it printed containing "ERROR", the gateway's
responses by outcome (read from its /metrics), the first call's prompt tokens and how
long its response took (prefill, then the reply), the seconds Codex ran and the
mode's wall seconds, the 1-minute load average as Codex ended.

    codex_real_model_ok_<mode> = exit 0, no ERROR line, and every response ended
                                 completed or incomplete (none errored, failed, or was
                                 dropped by a client that gave up)
    codex_real_model_ok        = every mode ok
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from once.bench.clients.node_clients import ClientRun, run_codex
from once.bench.clients.python_clients import git_workspace
from once.bench.engine_bench.contention import busy_processes, stop
from once.fleet.launcher import OnceService
from once.fleet.processes import stop_processes, wait_all_healthy
from once.fleet.vllm_server import free_port
from once.model_files import DEFAULT_MODEL

MODES = ("http", "websocket")
MAX_MODEL_LEN = 32768
KV_CACHE_GIB = 1.5  # ~34k tokens of SmolLM2-135M's KV: the whole window
DEFAULT_MAX_OUTPUT_TOKENS = 256
# SmolLM2-135M's 8,192 trained positions stretched to the window.
ROPE_SCALING = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}'
PROMPT = "What time is it in UTC? Use the time tool."
HANG_GUARD_S = 3600.0  # a hung run's bound, not a budget: a busy machine is only slower
STARTUP_TIMEOUT_S = 600.0  # the same, for `once serve` to answer /healthz
STOP_TIMEOUT_S = 30.0
METRICS_POLL_S = 1.0
METRICS_TIMEOUT_S = 30.0  # one /metrics read from a server busy prefilling
# How a response may end and still count as answered; anything else ("error",
# "response.failed", "disconnected": the client left) fails the mode.
ANSWERED = frozenset({"response.completed", "response.incomplete"})


def error_lines(run: ClientRun) -> list[str]:
    """Every line Codex printed (stderr, then stdout) that contains ERROR, verbatim."""
    lines = (run.stderr + "\n" + run.stdout).splitlines()
    return [line.strip() for line in lines if "ERROR" in line]


def metric_samples(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> {sample name: {sorted label items: value}}."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def responses_by_outcome(samples: dict[str, dict[tuple, float]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for labels, value in samples.get("once_gateway_requests_total", {}).items():
        outcome = dict(labels)["outcome"]
        counts[outcome] = counts.get(outcome, 0) + int(value)
    return counts


def _total(samples: dict[str, dict[tuple, float]], name: str) -> int:
    return int(sum(samples.get(name, {}).values()))


def first_call_prompt_tokens(readings: Sequence[tuple[int, int]]) -> int | None:
    """The prompt tokens of the first call that had any, from (prompt builds, prompt
    tokens) counter readings in time order; None when two builds fell between the last
    reading without tokens and the first with them (which one was first is unknown).
    Builds without tokens are Codex's WebSocket warm-up (nothing to prefill)."""
    empty_builds = 0
    for builds, tokens in readings:
        if tokens == 0:
            empty_builds = builds
        else:
            return tokens if builds - empty_builds == 1 else None
    return None


def mode_ok(result: dict) -> bool:
    outcomes = result["responses_by_outcome"]
    return (
        result["returncode"] == 0
        and not result["error_lines"]
        and bool(outcomes)
        and set(outcomes) <= ANSWERED
    )


@contextlib.contextmanager
def busy_beside(num_busy: int) -> Iterator[list[subprocess.Popen]]:
    """`num_busy` CPU-bound loops for the length of the block, stopped however it ends."""
    processes = busy_processes(num_busy)
    try:
        yield processes
    finally:
        stop(processes)


@dataclass(frozen=True)
class Served:
    """What the stage's `once serve` runs: the model, and the output budget of a request
    that sets none (its config file's `default_max_output_tokens`; 0: up to the context)."""

    model: str = DEFAULT_MODEL
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    rope_scaling: str = ROPE_SCALING  # "": the model's own positions only


def serve_command(
    port: int, config_path: Path, model: str = DEFAULT_MODEL, rope_scaling: str = ROPE_SCALING
) -> list[str]:
    scaling = ["--rope-scaling", rope_scaling] if rope_scaling else []
    return [
        sys.executable, "-m", "once.cli", "serve",
        "--model", model,
        "--max-model-len", str(MAX_MODEL_LEN),
        *scaling,
        "--kv-cache-gib", str(KV_CACHE_GIB),
        "--max-num-seqs", "4",
        "--store", "memory",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--config", str(config_path),
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def once_serve(folder: Path, served: Served = Served()) -> AsyncIterator[OnceService]:
    """`once serve` as a child process (logging to folder/serve.log), once it answers."""
    config_path = folder / "gateway.toml"
    config_path.write_text(f"[gateway]\ndefault_max_output_tokens = {served.max_output_tokens}\n")
    port = free_port()
    service = OnceService(
        "once serve",
        "127.0.0.1",
        port,
        serve_command(port, config_path, served.model, served.rope_scaling),
        folder / "serve.log",
    )
    # Started from this (the loop's) thread: the child's parent-death signal follows the
    # thread that forked it (processes.py).
    service.start()
    try:
        await asyncio.to_thread(wait_all_healthy, [service], STARTUP_TIMEOUT_S)
        yield service
    finally:
        await asyncio.to_thread(stop_processes, [service.process], STOP_TIMEOUT_S)


async def _read_metrics(http: httpx.AsyncClient, url: str) -> dict[str, dict[tuple, float]]:
    response = await http.get(f"{url}/metrics")
    response.raise_for_status()
    return metric_samples(response.text)


class Reading(NamedTuple):
    """The gateway's counters at one moment of a run."""

    at_s: float
    builds: int  # prompts built
    prompt_tokens: int
    responses: int  # responses ended, however


def first_response_s(readings: Sequence[Reading]) -> float | None:
    """From the first reading with a prompt's tokens to the first with that response
    ended: how long Codex's first stream lasted (its prefill is the silent part), to
    within METRICS_POLL_S. Builds before it (Codex's WebSocket warm-up, nothing to
    prefill) end at once, so it has ended when as many responses have as builds."""
    first = next((reading for reading in readings if reading.prompt_tokens > 0), None)
    if first is None:
        return None
    ended = next(
        (r for r in readings if r.at_s >= first.at_s and r.responses >= first.builds), None
    )
    return None if ended is None else round(ended.at_s - first.at_s, 1)


def _reading(samples: dict[str, dict[tuple, float]], origin: float) -> Reading:
    return Reading(
        round(time.perf_counter() - origin, 1),
        _total(samples, "once_gateway_renders_total"),
        _total(samples, "once_gateway_prompt_tokens_total"),
        _total(samples, "once_gateway_requests_total"),
    )


async def _watch(http: httpx.AsyncClient, url: str, readings: list[Reading], origin: float) -> None:
    """Appends a Reading every METRICS_POLL_S until cancelled."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            readings.append(_reading(await _read_metrics(http, url), origin))
        await asyncio.sleep(METRICS_POLL_S)


async def run_mode(
    mode: str, num_busy: int, served: Served = Served(), hang_guard_s: float = HANG_GUARD_S
) -> dict:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    started = time.perf_counter()
    mcp = [str(Path(sys.executable).parent / "mcp-server-time"), "--local-timezone", "UTC"]
    readings: list[Reading] = []
    with tempfile.TemporaryDirectory(prefix=f"once-codex-real-{mode}-") as folder:
        workspace = git_workspace(Path(folder) / "repo")
        async with (
            once_serve(Path(folder), served) as server,
            httpx.AsyncClient(timeout=METRICS_TIMEOUT_S) as http,
        ):
            with busy_beside(num_busy):
                watcher = asyncio.create_task(_watch(http, server.url, readings, started))
                try:
                    done = await run_codex(
                        server.url,
                        workspace,
                        PROMPT,
                        websocket=mode == "websocket",
                        mcp_command=mcp,
                        timeout_s=hang_guard_s,
                    )
                finally:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                load = os.getloadavg()[0]
            samples = await _read_metrics(http, server.url)
            readings.append(_reading(samples, started))  # the last response's end
            log_tail = server.log_tail()
    result = {
        "returncode": done.returncode,
        "hang_guard_hit": done.returncode is None,
        "error_lines": error_lines(done),
        "responses_by_outcome": responses_by_outcome(samples),
        "first_call_prompt_tokens": first_call_prompt_tokens(
            [(r.builds, r.prompt_tokens) for r in readings]
        ),
        "first_response_s": first_response_s(readings),
        "prompt_builds": _total(samples, "once_gateway_renders_total"),
        "prompt_tokens": _total(samples, "once_gateway_prompt_tokens_total"),
        "cached_tokens": _total(samples, "once_gateway_cached_tokens_total"),
        "output_tokens": _total(samples, "once_gateway_output_tokens_total"),
        "codex_s": round(done.seconds, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "load_avg_1m": round(load, 2),
        "final_message": done.stdout.strip()[-500:],
        "codex_config": done.config,
    }
    result["ok"] = mode_ok(result)
    if not result["ok"]:  # what to read first when it fails
        result["stderr_tail"] = done.stderr.strip().splitlines()[-30:]
        result["serve_log_tail"] = log_tail.splitlines()[-30:]
    return result


async def run(
    num_busy: int = 1,
    modes: Sequence[str] = MODES,
    served: Served = Served(),
    hang_guard_s: float = HANG_GUARD_S,
    log=None,
) -> dict:
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    started = time.perf_counter()
    results: dict = {}
    for mode in modes:
        log(f"codex exec on {served.model} over {mode}, {num_busy} busy beside it ...")
        results[mode] = await run_mode(mode, num_busy, served, hang_guard_s)
        log(f"  {render_mode(mode, results[mode])}")
    report: dict = {
        "codex_real_model": results,
        "codex_real_model_served": served.model,
        "codex_real_model_max_output_tokens": served.max_output_tokens,
        "codex_real_model_rope_scaling": served.rope_scaling or None,
        "codex_real_model_busy": num_busy,
        "codex_real_model_cores": len(os.sched_getaffinity(0)),
    }
    for mode, result in results.items():
        report[f"codex_real_model_ok_{mode}"] = result["ok"]
    report["codex_real_model_ok"] = all(result["ok"] for result in results.values())
    report["codex_real_model_wall_s"] = round(time.perf_counter() - started, 1)
    return report


def render_mode(mode: str, result: dict) -> str:
    return (
        f"{mode}: ok={result['ok']} exit={result['returncode']} "
        f"ERROR lines={len(result['error_lines'])} responses={result['responses_by_outcome']} "
        f"first call {result['first_call_prompt_tokens']} prompt tokens in "
        f"{result['first_response_s']} s, codex {result['codex_s']} s, "
        f"load {result['load_avg_1m']}"
    )
