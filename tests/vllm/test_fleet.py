"""`once fleet up` as a user runs it: one vLLM replica, `once router` over it and `once serve`
in front, from a fleet file; a Chat Completions and a Responses call through the gateway;
then SIGTERM: the launcher exits 0 and no process of the fleet is left (vLLM's engine
core and workers included: each server's session is empty).

The fleet starts its own vLLM server (about 30-60 s here), before the shared pair of
conftest.py starts (this file sorts first). Nothing waits on a fixed budget short enough
to fail on a slow machine: HANG_GUARD_S only stops a hung run."""

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import pytest

from once.fleet.vllm_server import vllm_missing_reason
from tests.vllm.conftest import MODEL

HANG_GUARD_S = 1800.0
FLEET = """
[gateway]
port = 0
safety = "off"
store = "memory"
[vllm]
kv_cache_mib = 256
threads = 1
"""


def session_members(leader: int) -> list[int]:
    """The live (not zombie) processes whose session is `leader`'s."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])
        if session == leader and state != "Z":
            members.append(int(entry.name))
    return members


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def until_ready(process: subprocess.Popen, lines: queue.Queue, seen: list[str]) -> str:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(f"once fleet up exited ({process.wait()}):\n" + "\n".join(seen))
        seen.append(line)
        if line.startswith("fleet ready: "):
            return line.split()[2]
    raise AssertionError("once fleet up hung:\n" + "\n".join(seen))


def test_fleet_up_serves_both_apis_and_sigterm_leaves_nothing_running(tmp_path):
    reason = vllm_missing_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(FLEET)
    log_dir = tempfile.mkdtemp(prefix="fleet-")  # short: vLLM's KV-events ipc socket is in it
    process = subprocess.Popen(
        [sys.executable, "-m", "once.cli", "fleet", "up", str(fleet_file), "--log-dir", log_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        base_url = until_ready(process, lines, seen)
        ready = [line for line in seen if " ready  pid " in line]
        assert [line.split()[0] for line in ready] == ["vllm-0", "router", "gateway"]
        pids = [int(re.search(r"pid (\d+)", line)[1]) for line in ready]
        ports = [int(re.search(r"http://127\.0\.0\.1:(\d+)", line)[1]) for line in ready]

        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=600.0)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1
        response = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8)
        assert response.status in ("completed", "incomplete") and response.output_text
        client.close()

        process.send_signal(signal.SIGTERM)
        assert process.wait(HANG_GUARD_S) == 0, "\n".join(seen)
    finally:
        if process.poll() is None:
            process.kill()  # its servers get SIGTERM from the kernel (PR_SET_PDEATHSIG)
            process.wait()
    while (line := lines.get(timeout=60)) is not None:
        seen.append(line)
    assert seen[-1] == "fleet: stopped", "\n".join(seen)
    # The launcher waited for every session leader and killed what outlived its leader;
    # a SIGKILL takes a moment to land, so the sessions are polled (a hang guard only).
    deadline = time.monotonic() + 120.0
    while any(session_members(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [session_members(pid) for pid in pids] == [[], [], []]
    assert not any(port_open(port) for port in ports)
    assert (Path(log_dir) / "vllm-0" / "vllm.log").stat().st_size > 0
    assert "once gateway: " in (Path(log_dir) / "gateway.log").read_text()
    shutil.rmtree(log_dir)
