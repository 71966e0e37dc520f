"""sglang-router (SGLang's model gateway, from PyPI) in front of live vLLM servers: the peer
router a routed vLLM replay compares once's with (`--policies ... sglang_router`).

    async with sglang_router(["http://127.0.0.1:8001", ...], log_folder) as url:
        ...  # url serves /v1/completions, routed by its cache_aware policy

`make vllm` installs it into vLLM's virtualenv (`sglang-router`, a Rust binary behind a
Python launcher). What it can do in front of vLLM (0.3.2 over vLLM 0.32, tried here):
- it takes vLLM servers as workers: their missing `/get_server_info` and
  `/get_model_info` only cost a warning; `/readiness` answers 200 once one is healthy;
- `/v1/completions` passes vLLM's own fields through (`return_token_ids`, `cache_salt`,
  `structured_outputs`, `stream_options`) and streams vLLM's chunks back unchanged;
- a prompt of token ids is refused (HTTP 422: its prompt type is a string or a list of
  strings), so the gateway sends the prompt's text and vLLM tokenizes it again;
- cache_aware matches prefixes on the request's text (a radix tree of characters), and
  sends a request whose best match is under its threshold (0.3) to the least loaded
  worker, counting the requests it has in flight.
Its metrics server would bind 0.0.0.0:29000; it is pinned to a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx

from once.fleet.vllm_server import free_port, vllm_python

SGLANG_ROUTER_POLICY = "sglang_router"  # the name of its stack among once's policies
STOP_TIMEOUT_S = 10.0


class SglangRouterError(RuntimeError):
    """The router exited during startup."""


def sglang_router_command(worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
    return [
        str(vllm_python()), "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-urls", *worker_urls,
        "--policy", "cache_aware",
        "--disable-retries",  # as once's router in a replay: a failure is reported, not hidden
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def sglang_router(worker_urls: Sequence[str], log_folder: Path) -> AsyncIterator[str]:
    """The router's base URL once it reports a healthy worker; stopped on the way out."""
    port = free_port()
    log_folder.mkdir(parents=True, exist_ok=True)
    log_path = log_folder / f"sglang-router.{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            sglang_router_command(worker_urls, port, free_port()),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(process, url, log_path)
        yield url
    finally:
        await asyncio.to_thread(_stop, process)


async def _wait_ready(process: subprocess.Popen, url: str, log_path: Path) -> None:
    """Until /readiness answers 200: a slow machine only makes this slower."""
    async with httpx.AsyncClient(timeout=None) as http:
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise SglangRouterError(f"sglang-router exited with {process.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/readiness")).status_code == 200:
                    return
            await asyncio.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
