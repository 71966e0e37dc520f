"""The fleet's wiring and watch without vLLM: the router's and gateway's commands as their
own parsers read them, startup that fails fast with the log of a server that exited, a
watch that names the server that died, and a stop that leaves no process behind.

The servers here are small Python HTTP servers in child processes (a few seconds in all);
tests/vllm/test_fleet.py runs the real fleet."""

import os
import re
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from once.fleet.cli import main as fleet_main
from once.fleet.fleet_file import load_fleet_file
from once.fleet.launcher import OnceService, build_fleet, busy_ports, watch
from once.fleet.processes import (
    StartError,
    is_running,
    kill_session,
    stop_processes,
    wait_all_healthy,
)
from once.gateway.config import GatewayConfig
from once.router.serve import build_parser as router_parser

HEALTHY_SERVER = textwrap.dedent("""
    import http.server, sys
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")

LEADER_WITH_A_WORKER = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("worker", worker.pid, flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    """A live process (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def service(tmp_path, name: str, code: str = HEALTHY_SERVER) -> OnceService:
    port = free_port()
    command = [sys.executable, "-c", code, str(port)]
    return OnceService(name, "127.0.0.1", port, command, tmp_path / f"{name}.log")


def fleet_of(tmp_path, text: str):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    folder = tmp_path / "model"
    folder.mkdir()
    return build_fleet(load_fleet_file(path), folder, tmp_path / "logs")


def test_the_router_gets_every_replica_with_its_kv_events_and_the_gateway_gets_the_router(
    tmp_path,
):
    fleet = fleet_of(tmp_path, """
        served_model_name = "small"
        [gateway]
        port = 0
        safety = "off"
        rate_limit_storage = "redis://127.0.0.1:6379"
        [router]
        policy = "cache_aware"
        [vllm]
        count = 2
        max_model_len = 2048
        [[vllm.replica]]
        [[vllm.replica]]
        kv_events = false
    """)  # fmt: skip
    first, second = fleet.servers
    assert first.port != second.port and first.kv_events_endpoint.startswith("ipc://")
    args = router_parser().parse_args(fleet.router.command[4:])  # after python -m once.cli router
    assert args.openai_url == [first.url, second.url]
    assert args.openai_kv_events == [first.kv_events_endpoint, "-"]
    assert (args.openai_model, args.policy, args.block_size) == ("small", "cache_aware", 32)
    assert args.port == fleet.router.port

    gateway = fleet.gateway.command
    assert gateway[gateway.index("--engine-url") + 1] == fleet.router.url
    assert gateway[gateway.index("--max-model-len") + 1] == "2048"
    assert "--no-safety" in gateway
    config = GatewayConfig.load(gateway[gateway.index("--config") + 1])
    assert config.aliases is not None and config.aliases["small"] == "smollm2-135m-instruct"
    assert config.rate_limit_storage == "redis://127.0.0.1:6379"


def test_a_fixed_port_in_use_is_named(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = tmp_path / "fleet.toml"
        path.write_text(f"[router]\nport = {port}\n")
        assert busy_ports(load_fleet_file(path)) == [
            f"[router] port {port}: Address already in use"
        ]


def test_startup_fails_fast_with_the_log_of_a_server_that_exited(tmp_path):
    healthy = service(tmp_path, "healthy")
    broken = service(tmp_path, "broken", "print('no model here'); raise SystemExit(3)")
    try:
        for server in (healthy, broken):
            server.start()
        started = time.monotonic()
        with pytest.raises(StartError, match="broken exited with code 3") as caught:
            wait_all_healthy([healthy, broken], timeout_s=600)
        assert "no model here" in str(caught.value)
        assert time.monotonic() - started < 300  # not the hang guard
    finally:
        stop_processes([healthy.process, broken.process], timeout_s=30)
    assert not is_running(healthy.process)


def test_the_watch_names_the_server_that_died_and_the_stop_leaves_none(tmp_path):
    servers = [service(tmp_path, name) for name in ("router", "gateway")]
    ready = []
    try:
        for server in servers:
            server.start()
        wait_all_healthy(servers, timeout_s=600, on_healthy=ready.append)
        assert sorted(server.name for server in ready) == ["gateway", "router"]
        assert servers[0].process is not None
        servers[0].process.kill()
        assert watch(servers, print) is servers[0]
    finally:
        stop_processes([server.process for server in servers], timeout_s=30)
    assert not any(is_running(server.process) for server in servers)
    assert "serving" in servers[1].log_tail()


def test_up_without_vllm_says_to_run_make_vllm(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ONCE_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    path = tmp_path / "fleet.toml"
    path.write_text("")
    assert fleet_main(["up", str(path), "--log-dir", str(tmp_path / "logs")]) == 1
    assert "run `make vllm`" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # nothing started, nothing made


def test_the_stop_takes_what_a_killed_leader_left_in_its_session(tmp_path):
    # As vLLM's engine core outlives its SIGKILLed API server.
    leader = service(tmp_path, "leader", LEADER_WITH_A_WORKER)
    leader.start()
    assert leader.process is not None
    worker = None
    try:
        deadline = time.monotonic() + 600
        while not (printed := re.search(r"^worker (\d+)$", leader.log_tail(), re.MULTILINE)):
            assert time.monotonic() < deadline and is_running(leader.process), leader.log_tail()
            time.sleep(0.1)
        worker = int(printed[1])
        leader.process.kill()
        leader.process.wait()
        assert alive(worker)
        stop_processes([leader.process], timeout_s=30)
        deadline = time.monotonic() + 60  # a SIGKILL lands at once; its reaping may lag
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)
        kill_session(leader.process)
