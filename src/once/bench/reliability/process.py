"""The gateway process the load and rejection measurements drive, and what they read of it.

The process is gateway_server.py, started with this package's own src folder first on
PYTHONPATH (so a worktree measures its own code) and its stderr in a file (a pipe nobody
reads would fill and stall the server); what it logged comes back with the figures.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from once.bench.gateway_bench.overhead import free_port, wait_until_healthy

_SRC = str(Path(__file__).resolve().parents[3])  # the src folder this package is in


class GatewayProcess:
    def __init__(
        self, *, token_rate: float = 50.0, output_tokens: int = 32, max_model_len: int = 8192
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        path = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH")) if p)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "once.bench.reliability.gateway_server",
             "--port", str(self.port), "--token-rate", str(token_rate),
             "--output-tokens", str(output_tokens), "--max-model-len", str(max_model_len)],
            stdout=subprocess.DEVNULL, stderr=self._log, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        self.pid = self.server.pid
        try:
            wait_until_healthy(self.server, self.url, "gateway")
        except BaseException as e:
            self.stop()
            raise RuntimeError(f"the gateway did not start: {self.log_tail()}") from e

    def log_tail(self, num_chars: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-num_chars:]

    def num_log_lines(self) -> int:
        self._log.seek(0)
        return sum(1 for _ in self._log)

    def stop(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait(10)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for process {self.pid}")

    def cpu_s(self) -> float:
        """CPU time of all the process's threads, to the nanosecond (schedstat's first
        field; /proc/PID/stat counts in 10 ms ticks, too coarse for one request)."""
        total_ns = 0
        for path in glob.glob(f"/proc/{self.pid}/task/*/schedstat"):
            try:
                with open(path) as f:
                    total_ns += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile
        return total_ns / 1e9
