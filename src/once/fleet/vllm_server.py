"""Live vLLM servers on loopback: started from vLLM's own virtualenv, watched, always reaped.

    spec = VllmSpec(model_folder, served_model_name="smollm2", kv_cache_mib=512)
    async with start_vllm_servers([spec, spec]) as servers:
        servers[0].url, servers[0].kv_events_endpoint   # OpenAI API; ZMQ KV events
        servers[1].kill(); await servers[1].restart()    # failover and rejoin

vLLM lives in its own virtualenv (`make vllm` makes `.venv-vllm` beside `.venv`; another
one is named by `ONCE_VLLM_PYTHON`), so its pins never touch once's. Each server is
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the CPU
build looks for a distribution named `vllm` and fails) bound to 127.0.0.1, with:
- `--enforce-eager`: no torch.compile (minutes per start on two busy cores), unless the
  spec asks for vLLM's compiled default (the engine bench does);
- `--block-size 32`: the CPU attention backend takes multiples of 32 only, and its
  default, 128, would recompute up to 127 tokens a turn that a 32-token block keeps;
- `--kv-cache-memory-bytes`: a bounded KV cache (`VLLM_CPU_KVCACHE_SPACE` is whole GiB);
- KV events published on an `ipc://` socket in the server's own temporary folder (vLLM
  binds `*`, `::` and ipc endpoints and connects to any other, so ipc keeps it local);
- llguidance for structured outputs (openai_replica.py says why);
- `VLLM_SERVER_DEV_MODE=1` for `/reset_prefix_cache` (a replay empties caches between
  the stacks it compares).
A server runs in its own session (so a kill takes its engine-core and worker processes
too) and gets SIGTERM when the process that started it dies (PR_SET_PDEATHSIG), so none
outlives its test or fleet (processes.py). Startup waits until /health answers or the
process exits: a slow machine only makes it slower; `startup_timeout_s` is a hang guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from once.fleet.processes import (
    StartError,
    is_running,
    kill_session,
    read_tail,
    spawn,
    stop_processes,
    wait_all_healthy,
)
from once.router.vllm_metrics import VllmMetrics, parse_vllm_metrics

STARTUP_TIMEOUT_S = 1800.0  # a hang guard: a first start on a loaded 2-core machine takes minutes
STOP_TIMEOUT_S = 20.0
VllmStartError = StartError  # a vLLM server exited or stayed silent during startup


class VllmUnavailableError(RuntimeError):
    """vLLM's virtualenv is missing: `make vllm` makes it."""


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: $ONCE_VLLM_PYTHON, else `.venv-vllm` beside the
    virtualenv once runs from."""
    named = os.environ.get("ONCE_VLLM_PYTHON")
    if named:
        return Path(named)
    return Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"


def vllm_missing_reason() -> str | None:
    python = vllm_python()
    if not python.exists():
        return f"vLLM is not installed ({python} is missing): run `make vllm`"
    return None


@dataclass(frozen=True)
class VllmSpec:
    model_folder: Path
    served_model_name: str = "smollm2"
    kv_cache_mib: int = 512
    block_size: int = 32
    max_model_len: int = 4096
    threads: int = 0  # OMP threads; 0: this machine's cores
    prefix_caching: bool = True
    kv_events: bool = True
    skip_tokenizer_init: bool = False  # token ids only: vLLM then cannot tokenize anything
    enforce_eager: bool = True  # False: vLLM's default torch.compile (minutes to start)
    dtype: str = "float32"  # "bfloat16": vLLM's CPU path in bf16 (AVX512-BF16 where present)
    extra_args: tuple[str, ...] = ()


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class VllmServer:
    spec: VllmSpec
    name: str
    port: int
    folder: Path  # its log and its KV-events socket
    process: subprocess.Popen | None = None
    num_starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"ipc://{self.folder / 'kv-events.ipc'}" if self.spec.kv_events else ""

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    @property
    def log_path(self) -> Path:
        return self.folder / "vllm.log"

    def command(self) -> list[str]:
        spec = self.spec
        command = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model_folder),
            "--served-model-name", spec.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", spec.dtype,
            "--max-model-len", str(spec.max_model_len),
            "--block-size", str(spec.block_size),
            "--kv-cache-memory-bytes", str(spec.kv_cache_mib * 2**20),
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            # llguidance, as once's engine: it reads the gateway's grammars as they are.
            "--structured-outputs-config", '{"backend": "guidance"}',
        ]  # fmt: skip
        if spec.enforce_eager:
            command.append("--enforce-eager")
        command.append(
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching"
        )
        if spec.kv_events:
            config = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": self.kv_events_endpoint}  # fmt: skip
            command += ["--kv-events-config", json.dumps(config)]
        if spec.skip_tokenizer_init:
            command.append("--skip-tokenizer-init")
        return command + list(spec.extra_args)

    def environment(self) -> dict[str, str]:
        threads = self.spec.threads or len(os.sched_getaffinity(0))
        return os.environ | {
            "OMP_NUM_THREADS": str(threads),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with the rest of the box
        }

    def start(self) -> None:
        self.num_starts += 1
        self.process = spawn(
            self.command(), self.log_path, f"start {self.num_starts}", self.environment()
        )

    def alive(self) -> bool:
        return is_running(self.process)

    def log_tail(self) -> str:
        return read_tail(self.log_path)

    def wait_healthy_blocking(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_all_healthy([self], timeout_s)

    async def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        await asyncio.to_thread(self.wait_healthy_blocking, timeout_s)

    def kill(self) -> None:
        """SIGKILL to the server's whole session: it dies mid-request, as a crashed host."""
        process = self.process
        if process is not None and process.poll() is None:
            kill_session(process)

    def stop_blocking(self) -> None:
        stop_processes([self.process], STOP_TIMEOUT_S)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_blocking)

    async def restart(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start again on the same port and KV-events socket (a replica coming back).
        Started from the caller's thread: a server dies with the thread that forked it."""
        await self.stop()
        self.start()
        await self.wait_healthy(timeout_s)

    async def metrics(self) -> VllmMetrics:
        async with httpx.AsyncClient(timeout=60.0) as http:
            response = await http.get(f"{self.url}/metrics")
        response.raise_for_status()
        return parse_vllm_metrics(response.text)

    async def reset_prefix_cache(self) -> None:
        async with httpx.AsyncClient(timeout=60.0) as http:
            response = await http.post(f"{self.url}/reset_prefix_cache")
        response.raise_for_status()


def _make_servers(specs: Sequence[VllmSpec], log_folder: Path) -> list[VllmServer]:
    servers = []
    for i, spec in enumerate(specs):
        folder = Path(log_folder) / f"vllm-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        servers.append(VllmServer(spec, f"vllm-{i}", free_port(), folder))
    return servers


class _StartedServers:
    """One server per spec, started (not yet healthy) in `log_folder/vllm-i` (a temporary
    folder when None); `close` stops them all together and removes that folder."""

    def __init__(self, specs: Sequence[VllmSpec], log_folder: Path | None):
        reason = vllm_missing_reason()
        if reason:
            raise VllmUnavailableError(reason)
        self.temporary: tempfile.TemporaryDirectory[str] | None = None
        if log_folder is None:
            self.temporary = tempfile.TemporaryDirectory(prefix="vllm-")
            log_folder = Path(self.temporary.name)
        self.servers = _make_servers(specs, log_folder)
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop_processes([server.process for server in self.servers], STOP_TIMEOUT_S)
        if self.temporary is not None:
            self.temporary.cleanup()


@contextlib.contextmanager
def vllm_servers(
    specs: Sequence[VllmSpec],
    *,
    log_folder: Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[list[VllmServer]]:
    """One server per spec, named vllm-0..N-1, yielded once every one answers /health;
    all started at once (they share the cores while they load). Logs go to
    `log_folder/vllm-i/vllm.log` (a temporary folder when None)."""
    started = _StartedServers(specs, log_folder)
    try:
        wait_all_healthy(started.servers, startup_timeout_s)
        yield started.servers
    finally:
        started.close()


@contextlib.asynccontextmanager
async def start_vllm_servers(
    specs: Sequence[VllmSpec],
    *,
    log_folder: Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> AsyncIterator[list[VllmServer]]:
    """`vllm_servers` for asyncio: started on the loop's thread (a server gets SIGTERM when
    the thread that forked it ends), waited for and stopped off it."""
    started = _StartedServers(specs, log_folder)
    try:
        await asyncio.to_thread(wait_all_healthy, started.servers, startup_timeout_s)
        yield started.servers
    finally:
        await asyncio.to_thread(started.close)
