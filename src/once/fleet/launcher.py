"""`once fleet up`: N vLLM replicas, `once router` over them, `once serve` in front.

The order is the data's: the vLLM servers start together (they share the cores while they
load), then the router (it reads the block size and pool size from the first server's
/metrics and subscribes to every server's KV events), then the gateway (its engine is the
router, `--engine-url`: the router speaks once's engine API, not /v1/completions). Each
one's health URL must answer before the next starts; each is a child process in its own
session with PR_SET_PDEATHSIG (processes.py), logging to its own file in one folder.

Then the launcher watches: a server that exits is reported with its log's tail and the
rest are stopped (exit 1); SIGINT or SIGTERM stops the fleet (exit 0). Stopping goes
front to back: the gateway (no new requests), the router, then every vLLM server at once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from once.fleet.fleet_file import FleetFile
from once.fleet.processes import (
    POLL_S,
    StartError,
    Watched,
    answers_health,
    how_it_ended,
    is_running,
    read_tail,
    spawn,
    stop_processes,
    wait_all_healthy,
)
from once.fleet.vllm_server import (
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    VllmServer,
    VllmSpec,
    free_port,
    vllm_missing_reason,
)
from once.gateway.aliases import default_table

ONCE_STOP_TIMEOUT_S = 30.0  # the servers' 3 s grace, cancelled requests' aborts, exit
HEALTH_EVERY_S = 10.0
HEALTH_TIMEOUT_S = 30.0  # a loaded machine answers late; no answer in this long is reported
MAX_IPC_PATH = 107  # a Unix socket path's limit (sun_path, less its NUL)


class FleetStopped(Exception):
    """SIGINT or SIGTERM reached the launcher."""


class FleetStartError(RuntimeError):
    """The fleet cannot start here (no vLLM, a port taken, a log folder too deep)."""


@dataclass
class OnceService:
    """`once router` or `once serve` as a child process."""

    name: str
    host: str
    port: int
    command: list[str]
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        local = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{local}:{self.port}/healthz"

    def start(self) -> None:
        self.process = spawn(self.command, self.log_path, f"start {time.ctime()}")

    def log_tail(self) -> str:
        return read_tail(self.log_path)


@dataclass
class Fleet:
    """A fleet file made concrete: ports chosen, folders made, commands written."""

    spec: FleetFile
    log_dir: Path
    servers: list[VllmServer]
    router: OnceService
    gateway: OnceService


def build_fleet(spec: FleetFile, model_folder: Path, log_dir: Path) -> Fleet:
    servers = []
    for i, replica in enumerate(spec.replicas):
        vllm = VllmSpec(
            model_folder,
            served_model_name=spec.served_model_name,
            kv_cache_mib=replica.kv_cache_mib,
            block_size=replica.block_size,
            max_model_len=replica.max_model_len,
            threads=replica.threads,
            prefix_caching=replica.prefix_caching,
            kv_events=replica.kv_events,
            extra_args=replica.extra_args,
        )
        folder = log_dir / f"vllm-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        server = VllmServer(vllm, f"vllm-{i}", replica.port or free_port(), folder)
        if len(server.kv_events_endpoint) > MAX_IPC_PATH + len("ipc://"):
            raise FleetStartError(
                f"log folder {log_dir} is too deep for vLLM's KV-events socket "
                f"({server.kv_events_endpoint}); give a shorter --log-dir"
            )
        servers.append(server)
    router_port = spec.router.port or free_port()
    router = OnceService(
        "router",
        "127.0.0.1",
        router_port,
        router_command(spec, servers, router_port),
        log_dir / "router.log",
    )
    gateway_port = spec.gateway.port or free_port()
    gateway = OnceService(
        "gateway",
        spec.gateway.host,
        gateway_port,
        gateway_command(spec, router.url, gateway_port, log_dir / "gateway.toml"),
        log_dir / "gateway.log",
    )
    return Fleet(spec, log_dir, servers, router, gateway)


def router_command(spec: FleetFile, servers: Sequence[VllmServer], port: int) -> list[str]:
    command = [sys.executable, "-m", "once.cli", "router",
               "--openai-model", spec.served_model_name,
               "--served-model-name", spec.served_model_name,
               "--policy", spec.router.policy, "--block-size", str(spec.block_size),
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    for server in servers:
        events = server.kv_events_endpoint or "-"
        command += ["--openai-url", server.url, "--openai-kv-events", events]
    for name, value in spec.router.policy_params.items():
        command += ["--policy-param", f"{name}={value}"]
    return command


def gateway_command(spec: FleetFile, router_url: str, port: int, config_path: Path) -> list[str]:
    """`once serve` at the router. Its [gateway] table (written to `config_path`) holds what
    has no flag: the served model's name as an alias, and the rate limits' storage."""
    gateway = spec.gateway
    command = [sys.executable, "-m", "once.cli", "serve", "--engine-url", router_url,
               "--model", spec.model, "--max-model-len", str(spec.max_model_len),
               "--host", gateway.host, "--port", str(port)]  # fmt: skip
    if gateway.safety == "off":
        command.append("--no-safety")
    else:
        command += ["--safety-policy", gateway.safety]
    if gateway.store:
        command += ["--store", gateway.store]
    if gateway.api_keys:
        command += ["--api-keys", str(gateway.api_keys)]
    lines = ["[gateway]"]
    if gateway.rate_limit_storage:
        lines.append(f"rate_limit_storage = {json.dumps(gateway.rate_limit_storage)}")
    if spec.served_model_name != spec.model:  # clients send the served name, as to vLLM
        aliases = default_table(spec.model) | {spec.served_model_name: spec.model}
        lines.append("[gateway.aliases]")
        lines += [f"{json.dumps(name)} = {json.dumps(model)}" for name, model in aliases.items()]
    if len(lines) > 1:
        config_path.write_text("\n".join(lines) + "\n")
        command += ["--config", str(config_path)]
    return command


def busy_ports(spec: FleetFile) -> list[str]:
    """The fleet file's fixed ports that something on this machine already holds."""
    named = [("[gateway] port", spec.gateway.host, spec.gateway.port),
             ("[router] port", "127.0.0.1", spec.router.port)]  # fmt: skip
    named += [(f"[[vllm.replica]] #{i + 1} port", "127.0.0.1", replica.port)
              for i, replica in enumerate(spec.replicas)]  # fmt: skip
    busy = []
    for name, host, port in named:
        if not port:
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind((host, port))
            except OSError as exc:
                busy.append(f"{name} {port}: {exc.strerror}")
    return busy


def run_fleet(spec: FleetFile, log_dir: Path, say: Callable[[str], None]) -> int:
    """Up, watched, and stopped; the exit status (0: stopped by a signal). FleetStartError
    when it cannot start at all."""
    reason = vllm_missing_reason()
    if reason:
        raise FleetStartError(reason)
    busy = busy_ports(spec)
    if busy:
        raise FleetStartError("ports in use: " + "; ".join(busy))
    from once.engine.loader import resolve_model_path  # noqa: PLC0415 - a GGUF converts: torch

    fleet = build_fleet(spec, resolve_model_path(spec.model), log_dir)
    say(f"fleet: logs in {log_dir}")
    with _signals_raise_stop():
        try:
            start_fleet(fleet, say)
            died = watch([*fleet.servers, fleet.router, fleet.gateway], say)
            say(f"fleet: {died.name} {how_it_ended(died.process)}; its log ends with:\n"
                f"{died.log_tail()}\nfleet: stopping the rest")  # fmt: skip
            return 1
        except FleetStopped as stop:
            say(f"fleet: {stop}: stopping")
            return 0
        except StartError as exc:
            say(f"fleet: {exc}\nfleet: stopping the rest")
            return 1
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)  # a second ^C must not cut the stop short
            stop_fleet(fleet)
            say("fleet: stopped")


def start_fleet(fleet: Fleet, say: Callable[[str], None]) -> None:
    def ready(server: Watched) -> None:
        say(describe(fleet, server))

    for server in fleet.servers:
        server.start()
    wait_all_healthy(fleet.servers, STARTUP_TIMEOUT_S, ready)
    for service in (fleet.router, fleet.gateway):
        service.start()
        wait_all_healthy([service], STARTUP_TIMEOUT_S, ready)
    count = len(fleet.servers)
    say(f"fleet ready: {fleet.gateway.url}/v1 serves {fleet.spec.served_model_name} "
        f"({count} vLLM replica{'s' * (count > 1)}); ^C or SIGTERM stops it")  # fmt: skip


def describe(fleet: Fleet, server: Watched) -> str:
    pid = server.process.pid if server.process else None
    if isinstance(server, VllmServer):
        events = server.kv_events_endpoint or "off"
        where = f"{server.url}  kv events {events}  log {server.log_path}"
    elif server is fleet.router:
        policy = fleet.spec.router.policy
        where = f"{fleet.router.url}  policy {policy}  log {fleet.router.log_path}"
    else:
        where = f"{fleet.gateway.url}/v1  log {fleet.gateway.log_path}"
    return f"{server.name:<8} ready  pid {pid}  {where}"


def watch(servers: Sequence[Watched], say: Callable[[str], None]) -> Watched:
    """Until one server exits: that one. Meanwhile each health URL is asked every
    HEALTH_EVERY_S and a change (no answer, answering again) is reported, not acted on:
    the router routes around a replica that stops answering."""
    answering = {server.name: True for server in servers}
    next_check = time.monotonic() + HEALTH_EVERY_S
    while True:
        for server in servers:
            if not is_running(server.process):
                return server
        if time.monotonic() >= next_check:
            for server in servers:
                ok = answers_health(server.health_url, HEALTH_TIMEOUT_S)
                if ok != answering[server.name]:
                    answering[server.name] = ok
                    state = "answers again" if ok else "does not answer"
                    say(f"fleet: {server.name} {state} at {server.health_url}")
            next_check = time.monotonic() + HEALTH_EVERY_S
        time.sleep(POLL_S)


def stop_fleet(fleet: Fleet) -> None:
    stop_processes([fleet.gateway.process], ONCE_STOP_TIMEOUT_S)
    stop_processes([fleet.router.process], ONCE_STOP_TIMEOUT_S)
    stop_processes([server.process for server in fleet.servers], STOP_TIMEOUT_S)


@contextlib.contextmanager
def _signals_raise_stop() -> Iterator[None]:
    def stop(signum: int, _frame: object) -> None:
        raise FleetStopped(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
