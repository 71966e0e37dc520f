"""`once engine` replicas for a routed replay: N server processes on loopback, always reaped,
and the router in front of them.

    async with start_replicas(folder, count=2, slow={1}, slowdown=2.0, threads=1,
                              max_model_len=..., kv_cache_gib=...) as replicas:
        ...  # replicas[i].url serves /v1/generate; replicas[i].kill() for failover tests

Each replica is `python -m once.cli engine --model FOLDER --port P ...` on 127.0.0.1. Ports
are drawn free from the OS (bind to port 0, read it, close); a replica that loses the
race for its port is started again on a new one. Startup is bounded: a replica that exits
or does not answer /healthz in time is a `ReplicaStartError` carrying the tail of its
stderr. On the way out every process is terminated, and killed if it does not stop.

A slow replica gets `--slowdown`: its engine sleeps after each step, so it serves at
1/slowdown of the speed of its peers on the same machine (engine/async_engine.py).

`open_fleet` adds the router (`Router` over `RemoteEngineClient`s, approximate prefix
indices as `once router` builds them) and the replay's view of the fleet: the engines'
counters summed over replicas, and which replica served a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from once.bench.local_redis import redis_server
from once.engine_http.client import RemoteEngineClient
from once.protocol.errors import OnceError
from once.router.disagg.split import SplitPolicy
from once.router.index import ExactPrefixIndex, zmq_event_subscriber
from once.router.replicas import Replica
from once.router.router import Router, RouterConfig

STARTUP_TIMEOUT_S = 120.0  # importing torch and loading weights on a busy 2-core machine
STOP_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3
STDERR_TAIL_CHARS = 2000


class ReplicaStartError(RuntimeError):
    """A replica process exited or stayed silent during startup."""


@dataclass
class ReplicaProcess:
    name: str
    port: int
    slowdown: float
    process: subprocess.Popen
    stderr_path: Path
    kv_events_endpoint: str = ""  # where it publishes KV events (ZMQ), "" for none

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: the replica dies mid-request, as a crashed machine would."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def engine_command(
    model_folder: Path,
    port: int,
    *,
    threads: int,
    max_model_len: int,
    kv_cache_gib: float,
    prefix_caching: bool,
    slowdown: float,
    speculative_method: str = "",
    kv_events_endpoint: str = "",
    extra_flags: Sequence[str] = (),
) -> list[str]:
    command = [
        sys.executable, "-m", "once.cli", "engine",
        "--model", str(model_folder),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", str(threads),
        "--max-model-len", str(max_model_len),
        "--kv-cache-gib", str(kv_cache_gib),
    ]  # fmt: skip
    if not prefix_caching:
        command.append("--no-prefix-caching")
    if slowdown != 1.0:
        command += ["--slowdown", str(slowdown)]
    if speculative_method:
        command += ["--speculative-method", speculative_method]
    if kv_events_endpoint:
        command += ["--kv-events-endpoint", kv_events_endpoint]
    return command + list(extra_flags)


@contextlib.asynccontextmanager
async def start_replicas(
    model_folder: Path,
    *,
    count: int,
    slow: Collection[int] = (),
    slowdown: float = 1.0,
    threads: int = 1,
    max_model_len: int,
    kv_cache_gib: float,
    prefix_caching: bool = True,
    speculative_method: str = "",
    kv_events: bool = False,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    extra_flags: Sequence[str] = (),
    flags_per_replica: Sequence[Sequence[str]] = (),
) -> AsyncIterator[list[ReplicaProcess]]:
    """`count` replicas named replica-0..N-1; those whose index is in `slow` run at
    1/`slowdown` speed; replica i gets `flags_per_replica[i]` after `extra_flags`. Yields
    them once every one answers /healthz."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if any(not 0 <= index < count for index in slow):
        raise ValueError(f"slow replica indices must lie in 0..{count - 1}, got {sorted(slow)}")
    replicas: list[ReplicaProcess] = []
    with tempfile.TemporaryDirectory(prefix="once-replicas-") as logs:

        def launch(index: int) -> ReplicaProcess:
            port = free_port()
            speed = slowdown if index in slow else 1.0
            events = f"tcp://127.0.0.1:{free_port()}" if kv_events else ""
            command = engine_command(
                model_folder, port, threads=threads, max_model_len=max_model_len,
                kv_cache_gib=kv_cache_gib, prefix_caching=prefix_caching, slowdown=speed,
                speculative_method=speculative_method, kv_events_endpoint=events,
                extra_flags=[*extra_flags, *(flags_per_replica[index] if flags_per_replica
                                             else ())],
            )  # fmt: skip
            stderr_path = Path(logs) / f"replica-{index}.{port}.stderr"
            with open(stderr_path, "wb") as stderr:
                process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr
                )
            return ReplicaProcess(f"replica-{index}", port, speed, process, stderr_path, events)

        try:
            replicas.extend(launch(index) for index in range(count))
            deadline = time.monotonic() + startup_timeout_s
            for attempt in range(PORT_ATTEMPTS):
                results = await asyncio.gather(
                    *(_wait_healthy(replica, deadline) for replica in replicas),
                    return_exceptions=True,
                )
                failures = [result for result in results if isinstance(result, BaseException)]
                if failures:
                    raise failures[0]
                lost_port = [i for i, result in enumerate(results) if result == "port_in_use"]
                if not lost_port:
                    break
                if attempt + 1 == PORT_ATTEMPTS:
                    raise ReplicaStartError(
                        f"{replicas[lost_port[0]].name}: no free port after {PORT_ATTEMPTS} tries"
                    )
                for i in lost_port:
                    replicas[i] = launch(i)
            yield replicas
        finally:
            await asyncio.gather(*(_stop(replica) for replica in replicas))


async def _wait_healthy(replica: ReplicaProcess, deadline: float) -> str:
    """'ok' once /healthz answers 200; 'port_in_use' if it exited on a taken port; any
    other exit, or the deadline, raises ReplicaStartError with its stderr tail."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as http:
        while True:
            code = replica.process.poll()
            if code is not None:
                tail = replica.stderr_tail()
                if "address already in use" in tail.lower():
                    return "port_in_use"
                raise ReplicaStartError(
                    f"{replica.name} (port {replica.port}) exited with code {code} during "
                    f"startup; its stderr ends with:\n{tail}"
                )
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(f"{replica.url}/healthz")).status_code == 200:
                    return "ok"
            if time.monotonic() > deadline:
                raise ReplicaStartError(
                    f"{replica.name} (port {replica.port}) did not answer /healthz within the "
                    f"startup timeout; its stderr ends with:\n{replica.stderr_tail()}"
                )
            await asyncio.sleep(0.1)


async def _stop(replica: ReplicaProcess) -> None:
    process = replica.process
    if process.poll() is not None:
        return
    process.terminate()
    try:
        await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        await asyncio.to_thread(process.wait)


# Engine stats that add up over replicas; the others (ratios, sizes) are per replica only.
SUMMED_STATS_EXTRA = ("step_time_s_total", "throttle_sleep_s")


@dataclass
class Fleet:
    processes: list[ReplicaProcess]
    clients: list[RemoteEngineClient]
    router: Router

    def __post_init__(self) -> None:
        self._last_stats: dict[str, dict] = {}  # replica name -> its last answered stats

    @property
    def slow_names(self) -> list[str]:
        return [p.name for p in self.processes if p.slowdown > 1.0]

    @property
    def block_size(self) -> int:
        return self.router.config.block_size

    def replica_pids(self) -> list[int]:
        return [p.process.pid for p in self.processes]

    async def engine_stats(self) -> dict:
        """The replicas' engine counters summed. A replica that does not answer (killed)
        counts with its last answered stats, so the sums never go back."""

        async def one(process, client):
            with contextlib.suppress(OnceError, httpx.HTTPError):
                self._last_stats[process.name] = await client.stats()

        await asyncio.gather(
            *(one(p, c) for p, c in zip(self.processes, self.clients, strict=True))
        )
        summed: dict = {}
        for stats in self._last_stats.values():
            for key, value in stats.items():
                adds_up = key.startswith("num_") or key in SUMMED_STATS_EXTRA
                if adds_up and isinstance(value, int | float) and not isinstance(value, bool):
                    summed[key] = summed.get(key, 0) + value
        summed["num_kv_evictions"] = summed.get("num_kv_evictions", 0)
        summed["replicas"] = dict(self._last_stats)
        return summed

    def replica_of(self, request_id: str) -> str | None:
        """The replica that served a request last (after the router's own retries)."""
        for decided_id, name in reversed(self.router.decisions):
            if decided_id == request_id:
                return name
        return None

    async def routing_stats(self) -> dict:
        stats = await self.router.stats()
        return {
            "policy": stats["policy"],
            "router": {key: stats[key] for key in self.router.counters},
            "requests_per_replica": {
                name: replica["num_routed"] for name, replica in stats["replicas"].items()
            },
            "finished_per_replica": {
                name: replica["num_finished"] for name, replica in stats["replicas"].items()
            },
            # What the once policy believed at the end: it must see the slow replica slower.
            "measured_speed": {
                name: {
                    "prefill_tokens_per_s": replica["prefill_tokens_per_s"],
                    "decode_tokens_per_s_per_stream": replica["decode_tokens_per_s_per_stream"],
                }
                for name, replica in stats["replicas"].items()
            },
            "slow_replicas": self.slow_names,
        }


@contextlib.asynccontextmanager
async def open_fleet(
    model_folder: Path,
    *,
    count: int,
    num_slow: int = 0,
    slowdown: float = 1.0,
    threads: int = 1,
    policy: str = "once",
    max_model_len: int,
    kv_cache_gib: float,
    prefix_caching: bool = True,
    speculative_method: str = "",
    exact_index: bool = True,
    pd: tuple[int, int] | None = None,
    pd_split: SplitPolicy | None = None,
    pd_transport: str = "shm",
    pd_shared_kv: bool = False,
) -> AsyncIterator[Fleet]:
    """`count` replicas (the last `num_slow` of them slow) behind a `Router(policy)`.

    exact_index: each replica publishes its KV events over ZMQ (as vLLM does) and the
    router follows them into an exact prefix index; otherwise the router keeps an
    approximate one from the prompts it routed. pd = (P, D): disaggregated instead, the
    first P replicas `--role prefill` (their KV store over `pd_transport`), the other D
    `--role decode`, and the router splits by `pd_split` (count must be P + D);
    `pd_shared_kv` gives them all a shared KV tier (a Redis of the fleet's own), where a
    prefill engine finds the prefix a decode engine computed instead of recomputing it."""
    if not 0 <= num_slow <= count:
        raise ValueError(f"slow replicas must be between 0 and {count}, got {num_slow}")
    slow = range(count - num_slow, count)
    roles = ["both"] * count
    flags: list[list[str]] = []
    if pd is not None:
        if sum(pd) != count or min(pd) < 1:
            raise ValueError(f"a P:D fleet needs P, D >= 1 and P + D = {count}, got {pd}")
        roles = ["prefill"] * pd[0] + ["decode"] * pd[1]
        flags = [["--role", role] + (["--kv-transfer", pd_transport] if role == "prefill" else [])
                 for role in roles]  # fmt: skip
    async with contextlib.AsyncExitStack() as closers:
        if pd_shared_kv:
            if pd is None:
                raise ValueError("pd_shared_kv needs a P:D fleet")
            folder = Path(closers.enter_context(tempfile.TemporaryDirectory(prefix="redis-")))
            redis = await closers.enter_async_context(redis_server(folder, durable=False))
            flags = [[*each, "--kv-shared-url", redis.url] for each in flags]
        processes = await closers.enter_async_context(start_replicas(
            model_folder, count=count, slow=slow, slowdown=slowdown, threads=threads,
            max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
            prefix_caching=prefix_caching, speculative_method=speculative_method,
            kv_events=exact_index, flags_per_replica=flags,
        ))  # fmt: skip
        async with _routed(processes, policy, exact_index, roles, pd_split) as fleet:
            yield fleet


@contextlib.asynccontextmanager
async def _routed(processes, policy, exact_index, roles, pd_split) -> AsyncIterator[Fleet]:
    """The fleet's router over its started engine processes, following their KV events."""
    clients = [RemoteEngineClient(process.url) for process in processes]
    indices = [ExactPrefixIndex() if exact_index else None for _ in processes]
    subscribers = [
        asyncio.create_task(zmq_event_subscriber(process.kv_events_endpoint, index))
        for process, index in zip(processes, indices, strict=True)
        if index is not None
    ]
    try:
        first = await clients[0].stats()
        replicas = [
            Replica(
                process.name,
                client,
                index=i,
                block_size=first["block_size"],
                kv_blocks_total=first["num_kv_blocks_total"],
                prefix_index=prefix_index,
                role=role,
            )
            for i, (process, client, prefix_index, role) in enumerate(
                zip(processes, clients, indices, roles, strict=True)
            )
        ]
        config = RouterConfig(policy=policy, block_size=first["block_size"], pd_split=pd_split)
        router = Router(replicas, config)
        try:
            yield Fleet(processes, clients, router)
        finally:
            await router.aclose()
    finally:
        for task in subscribers:
            task.cancel()
        await asyncio.gather(*subscribers, return_exceptions=True)
        await asyncio.gather(*(client.aclose() for client in clients))


def default_replica_threads(count: int) -> int:
    """The machine's cores shared evenly among the replicas (at least one each)."""
    return max(1, (os.cpu_count() or 1) // count)
