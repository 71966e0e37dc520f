"""The fleet's child processes: each logged to its own file, in its own session, reaped.

Every server of a fleet (vLLM, `once router`, `once serve`) is started here the same way:
- in a session of its own, so ^C in the terminal reaches only the launcher (which stops
  the servers in order) and a stop reaches a server's own children (vLLM's engine core);
- with PR_SET_PDEATHSIG, so the kernel sends it SIGTERM if its parent dies without
  stopping it (a SIGKILLed launcher or test). The signal follows the *thread* that forked
  the child, so servers are started from a thread that lives as long as they should;
- stdout and stderr appended to one log file, after a header line naming the command.
Startup waits until every server's health URL answers 200 or one of them exits: a slow
machine only makes it slower, and the timeout is a hang guard, not a budget.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import httpx

LOG_TAIL_CHARS = 3000
PR_SET_PDEATHSIG = 1
POLL_S = 0.5
PROBE_TIMEOUT_S = 5.0  # one /health call; a busy server that misses it is asked again


class StartError(RuntimeError):
    """A server exited or stayed silent during startup; the message ends with its log."""


class Watched(Protocol):
    """What startup and the fleet's watch need of a server (VllmServer, OnceService)."""

    name: str
    process: subprocess.Popen | None

    @property
    def health_url(self) -> str: ...

    def log_tail(self) -> str: ...


def die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    command: Sequence[str], log_path: Path, header: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        log.write(f"--- {header}: {' '.join(command)}\n".encode())
        log.flush()
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def read_tail(path: Path) -> str:
    """The log's last lines, up to LOG_TAIL_CHARS."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    if len(text) <= LOG_TAIL_CHARS:
        return text
    return text[-LOG_TAIL_CHARS:].partition("\n")[2]


def how_it_ended(process: subprocess.Popen | None) -> str:
    code = None if process is None else process.returncode
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def is_running(process: subprocess.Popen | None) -> bool:
    return process is not None and process.poll() is None


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL to the process's whole session (its own and its children's group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def stop_processes(processes: Sequence[subprocess.Popen | None], timeout_s: float) -> None:
    """SIGTERM to every process's session at once, then wait for all of them together;
    past `timeout_s` the rest are killed. So are session members that outlive their
    leader: vLLM's engine core and workers stay up when their API server is SIGKILLed.
    (A session's id stays taken while any member lives, so the signal finds only them.)"""
    started = [process for process in processes if process is not None]
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in started:
        kill_session(process)


def answers_health(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=timeout_s).status_code == 200
    return False


def wait_all_healthy(
    servers: Sequence[Watched],
    timeout_s: float,
    on_healthy: Callable[[Watched], None] | None = None,
) -> None:
    """Until every server's health URL answers 200 (each reported to `on_healthy` as it
    does); StartError as soon as one has exited, or after `timeout_s` (a hang guard)."""
    waiting = list(servers)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for server in list(waiting):
            if not is_running(server.process):
                raise StartError(
                    f"{server.name} {how_it_ended(server.process)} during startup; its log "
                    f"ends with:\n{server.log_tail()}"
                )
            if answers_health(server.health_url):
                waiting.remove(server)
                if on_healthy is not None:
                    on_healthy(server)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(server.name for server in waiting)
            raise StartError(
                f"{names} did not answer health checks in {timeout_s:.0f} s; the log of "
                f"{waiting[0].name} ends with:\n{waiting[0].log_tail()}"
            )
        if waiting:
            time.sleep(POLL_S)
