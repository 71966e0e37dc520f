"""`once serve` as a process: SIGTERM stops it within seconds, even with the engine busy.

A non-streamed request that would decode for minutes is in flight when the signal comes;
uvicorn's default waits for every open connection, so before issue 33 the process outlived
its SIGTERM by minutes. The deadline here is generous (a loaded machine), far below the
request's own length.
"""

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from once.cli import SHUTDOWN_GRACE_S
from once.model_files import DEFAULT_MODEL

pytestmark = pytest.mark.slow
START_DEADLINE_S = 120
STOP_DEADLINE_S = 30  # the grace (3 s), the cancelled request's abort, interpreter exit


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"once serve exited at start: {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("once serve did not start")


def busy_engine(url: str) -> None:
    # One non-streamed request decoding up to 2,000 tokens, left running.
    body = {
        "model": DEFAULT_MODEL,
        "input": "Write a very long story about a lighthouse keeper.",
        "max_output_tokens": 2000,
        "temperature": 1.0,
    }

    def post() -> None:
        try:
            httpx.post(f"{url}/v1/responses", json=body, timeout=600)
        except httpx.HTTPError:
            pass  # the server goes away under it: what the test does

    threading.Thread(target=post, daemon=True).start()
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if "once_gateway_inflight 1.0" in httpx.get(f"{url}/metrics", timeout=5).text:
            time.sleep(1.0)  # well into its work
            return
        time.sleep(0.1)
    raise AssertionError("the request never started")


def test_sigterm_stops_a_busy_server_within_seconds():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", "import sys; from once.cli import main; sys.exit(main())"]
    # At 1/20 of its speed the engine takes minutes for the request: it is surely busy.
    args = ["serve", "--port", str(port), "--no-safety", "--store", "memory", "--threads", "1",
            "--slowdown", "20"]  # fmt: skip
    process = subprocess.Popen(command + args, stdout=subprocess.DEVNULL)
    try:
        wait_until_up(url, process)
        busy_engine(url)
        signalled_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=STOP_DEADLINE_S)
        took_s = time.monotonic() - signalled_at
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # uvicorn shuts down, then raises the signal it caught again: the exit is SIGTERM's.
    assert process.returncode in (0, -signal.SIGTERM)
    assert SHUTDOWN_GRACE_S <= took_s < STOP_DEADLINE_S  # it waited for the grace, no more
