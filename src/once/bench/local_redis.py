"""A redis-server of our own for benchmarks and tests: loopback, a free port, killed after.

Durable (append-only file, fsync on every write) where a benchmark kills and restarts it
and counts what survived; not durable where it only serves a shared KV tier for one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import redis.asyncio as aioredis

from once.bench.gateway_bench.overhead import free_port

REDIS_START_TIMEOUT_S = 10.0


class RedisServer:
    """A redis-server of our own: loopback, a free port, durable writes in `folder`."""

    def __init__(self, folder: Path, durable: bool = True):
        self.folder = folder
        self.durable = durable
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        command = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.folder), "--save", "",
            *(("--appendonly", "yes", "--appendfsync", "always") if self.durable
              # a cache only: bounded, least recently used out first (as shared_tier.py
              # asks of an operator's Redis)
              else ("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru")),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = aioredis.from_url(self.url)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        try:
            while True:
                with contextlib.suppress(aioredis.ConnectionError):
                    await client.ping()
                    return
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a frozen one would not die either
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)


@contextlib.asynccontextmanager
async def redis_server(folder: Path, durable: bool = True) -> AsyncIterator[RedisServer]:
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
    server = RedisServer(folder, durable)
    try:
        await server.start()
        yield server
    finally:
        server.kill()
