"""The server processes the fault scenarios kill and restart, and how they run them.

    python -m once.bench.reliability.fault_servers replica --port P [--ttft-s S]
        a `once engine` server around a ScriptedEngine (forced outputs, or an echo)
    python -m once.bench.reliability.fault_servers gateway --port P --store SPEC [--reply T]
        the gateway around a ScriptedEngine that answers every request with T

Both bind 127.0.0.1. `running(args)` starts one and always reaps it:

    async with running(["replica", "--ttft-s", "0.5"], logs) as replica:
        replica.kill()           # SIGKILL: the process dies mid-request, as a crash would
        await replica.restart()  # the same command on the same port

Startup is bounded (`STARTUP_TIMEOUT_S`): a process that exits or does not answer /healthz
in time raises `ServerStartError` with the tail of its stderr. The child runs this
checkout's code: its PYTHONPATH starts with the folder the `once` package was imported
from.
"""

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import once
from once.bench.replay.replicas import free_port

STARTUP_TIMEOUT_S = 60.0  # imports and the tokenizer on a busy 2-core machine
STOP_TIMEOUT_S = 10.0
STDERR_TAIL_CHARS = 2000


class ServerStartError(RuntimeError):
    """A server process exited or stayed silent during startup."""


def _child_env() -> dict[str, str]:
    source = str(Path(once.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{path}" if path else source}


@dataclass
class ServerProcess:
    args: list[str]
    logs: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    num_starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stderr_path(self) -> Path:
        return self.logs / f"{self.args[0]}-{self.port}.stderr"

    async def start(self) -> None:
        command = [sys.executable, "-m", __name__, *self.args, "--port", str(self.port)]
        self.num_starts += 1
        with open(self.stderr_path, "ab") as stderr:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=_child_env(),
            )
        await self._wait_healthy(time.monotonic() + STARTUP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone (its port free again)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    async def restart(self) -> None:
        self.kill()
        await self.start()

    async def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
        except OSError:
            return ""

    async def _wait_healthy(self, deadline: float) -> None:
        assert self.process is not None
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as http:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(
                        f"{self.args[0]} on port {self.port} exited with code {code}; its "
                        f"stderr ends with:\n{self.stderr_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.url}/healthz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.args[0]} on port {self.port} did not answer /healthz in "
                        f"{STARTUP_TIMEOUT_S:.0f} s; its stderr ends with:\n{self.stderr_tail()}"
                    )
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(args: Sequence[str], logs: Path) -> AsyncIterator[ServerProcess]:
    server = ServerProcess(list(args), logs)
    try:
        await server.start()
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def running_all(commands: Sequence[Sequence[str]], logs: Path):
    """Several servers started at once (their imports overlap); all reaped."""
    servers = [ServerProcess(list(args), logs) for args in commands]
    try:
        await asyncio.gather(*(server.start() for server in servers))
        yield servers
    finally:
        await asyncio.gather(*(server.stop() for server in servers))


# -- the processes ------------------------------------------------------------------------


def _serve_replica(args: argparse.Namespace) -> None:
    import uvicorn

    from once.engine.scripted import ScriptedEngine
    from once.engine_http.server import build_engine_app

    engine = ScriptedEngine(ttft_s=args.ttft_s, token_latency_s=args.token_latency_s)
    app = build_engine_app(engine, model_name="scripted")
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def _serve_gateway(args: argparse.Namespace) -> None:
    import uvicorn

    from once.engine.scripted import ScriptedEngine
    from once.gateway.app import build_gateway_app, create_gateway
    from once.gateway.config import GatewayConfig
    from once.gateway.testing import load_runtime

    runtime = load_runtime()
    eos = runtime.tokenizer.eos_token_id
    reply = runtime.builder.encode(args.reply) + [eos]
    engine = ScriptedEngine(lambda request: reply, eos_token_id=eos)
    config = GatewayConfig(store=args.store, verify_every=1)
    app = build_gateway_app(create_gateway(config, engine, {runtime.name: runtime}))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", ws_max_size=1 << 24)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fault_servers", description=__doc__.split("\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    replica = kinds.add_parser("replica")
    replica.add_argument("--ttft-s", type=float, default=0.0)
    replica.add_argument("--token-latency-s", type=float, default=0.0)
    gateway = kinds.add_parser("gateway")
    gateway.add_argument("--store", required=True)
    gateway.add_argument("--reply", default="Noted.")
    for sub in (replica, gateway):
        sub.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.kind == "replica":
        _serve_replica(args)
    else:
        _serve_gateway(args)


if __name__ == "__main__":
    main()
