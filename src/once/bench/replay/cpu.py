"""CPU seconds per layer of a replay: harness, gateway, engine.

The replay process runs the harness transport and the gateway on one event loop, and (with
one replica) the engine in the same process, so process CPU alone cannot say who spent it.
Each layer is read from where its CPU is actually spent:

- engine: with an in-process engine, the threads of this process that belong to it: its
  step loop and the OpenMP workers it started, all named "once-engine" for the kernel
  (engine/os_threads.py), read from /proc/self/task/*/stat; with replica processes,
  their whole CPU, from /proc/<pid>/stat. A thread that has exited no longer shows in
  /proc: its CPU falls to the harness (the engine's live as long as the stack).
- gateway: the gateway's own CPU meter (`once_gateway_cpu_seconds_total{stage="request"}`),
  which times every request's work on the event loop and in its worker threads.
- harness: the rest of this process: its CPU minus the engine threads and the gateway.

A snapshot is cumulative; the difference of two is the CPU each layer spent in between.
Linux only (/proc); elsewhere every figure is 0 and `available` is False.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from once.engine.os_threads import ENGINE_THREAD_NAME, os_thread_name

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class CpuSnapshot:
    process_s: float
    engine_threads_s: float
    replica_processes_s: float
    gateway_s: float


def _stat_cpu_s(stat_path: Path) -> tuple[str, float] | None:
    """(comm, utime + stime in seconds) of a /proc stat file, None if it is gone."""
    try:
        text = stat_path.read_text()
    except OSError:
        return None
    # comm is in parentheses and may contain spaces; the fields after it are fixed.
    close = text.rindex(")")
    comm = text[text.index("(") + 1 : close]
    fields = text[close + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def engine_threads_cpu_s() -> float:
    """CPU of this process's engine threads: the step loop and the native (OpenMP) ones."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0.0
    total = 0.0
    for task in tasks.iterdir():
        if os_thread_name(task) != ENGINE_THREAD_NAME:
            continue  # the main thread (harness and gateway), the gateway's workers
        read = _stat_cpu_s(task / "stat")
        if read is not None:
            total += read[1]
    return total


def processes_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        read = _stat_cpu_s(Path(f"/proc/{pid}/stat"))
        if read is not None:
            total += read[1]
    return total


class LayerCpuMeter:
    """Snapshots of the layers' CPU for one stack: `gateway_cpu_s` reads the gateway's
    meter, `replica_pids` lists the replica processes (empty with an in-process engine)."""

    def __init__(self, gateway_cpu_s, replica_pids: list[int] | None = None):
        self.available = Path("/proc/self/task").is_dir()
        self._gateway_cpu_s = gateway_cpu_s
        self._replica_pids = list(replica_pids or [])

    def snapshot(self) -> CpuSnapshot:
        if not self.available:
            return CpuSnapshot(0.0, 0.0, 0.0, 0.0)
        return CpuSnapshot(
            process_s=time.process_time(),
            engine_threads_s=engine_threads_cpu_s(),
            replica_processes_s=processes_cpu_s(self._replica_pids),
            gateway_s=float(self._gateway_cpu_s()),
        )

    @staticmethod
    def between(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
        """CPU seconds per layer spent between two snapshots."""
        process = after.process_s - before.process_s
        engine_threads = after.engine_threads_s - before.engine_threads_s
        gateway = after.gateway_s - before.gateway_s
        engine = engine_threads + after.replica_processes_s - before.replica_processes_s
        return {
            "harness": round(max(0.0, process - engine_threads - gateway), 3),
            "gateway": round(gateway, 3),
            "engine": round(engine, 3),
        }


def add_cpu_seconds(report: dict, traffic: dict, stack_names) -> None:
    """CPU seconds per layer (harness, gateway, engine: cpu.py) of each stack in total, and
    per session when sessions ran one at a time."""
    for name in stack_names:
        report["total"][name]["cpu_s"] = traffic[name]["cpu_s"]
        for session_id, ledger in report["per_session"][name].items():
            per_session = traffic[name]["cpu_s_by_session"].get(session_id)
            if per_session is not None:
                ledger["cpu_s"] = per_session


def cpu_line(cpu_s: dict | None) -> str:
    if not cpu_s:
        return "not measured"
    return ", ".join(f"{layer} {seconds:.1f}" for layer, seconds in cpu_s.items())
