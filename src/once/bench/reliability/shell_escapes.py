"""Escape attempts from the `shell` tool, each a real command run by the real tool.

Each attempt runs a hostile command in the arena's sandbox and then checks the host:
files outside the workspace, the fake credentials' tokens in the output, a listener's
accept queue, processes with the attempt's marker in /proc. Bombs are bounded first: the
fork bomb runs only after a fork loop of a fixed size has shown that the process limit
holds, and the memory bomb asks for a fixed amount (twice the arena's limit), so a host
without limits loses a few hundred processes or megabytes, never the machine.
"""

import asyncio
import os
import re
import shlex
import socket
import sys
from pathlib import Path

from once.agent.policy import ApprovalPolicy
from once.agent.tools.base import ToolResult
from once.bench.reliability.sandbox_arena import (
    Arena,
    Attempt,
    Outcome,
    is_alive,
    marker,
    outcome,
    processes_with,
)

SHADOW_LINE = re.compile(r"(?m)^root:[^:\n]*:\d*:")
FORK_FAILURES = ("Cannot fork", "Resource temporarily unavailable")
HANG_GUARD_S = 10.0  # how long a process the call should have killed may take to vanish


async def write_outside(arena: Arena) -> Outcome:
    name = "shell_write_outside"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    out, token = arena.outside, marker()
    elsewhere = [arena.root / "sibling", Path(f"/etc/once-{token}"), Path(f"/dev/shm/once-{token}")]
    await arena.shell(
        f"echo x > {out}/direct; echo x > ../sibling; ln -s {out} link; echo x > link/via-link; "
        f"echo x > /proc/self/root{out}/via-proc; cp /etc/hostname {out}/copied; "
        f"mkdir {out}/dir; touch /etc/once-{token}; echo x > /dev/shm/once-{token}"
    )
    written = [*sorted(out.iterdir()), *(p for p in elsewhere if p.exists())]
    for path in elsewhere[1:]:
        path.unlink(missing_ok=True)
    escapes = [f"wrote {path}" for path in written]
    detail = "direct, ../, a symlink, /proc/self/root, /etc: read-only; /dev/shm: private"
    return outcome(name, escapes, detail)


async def remount_read_write(arena: Arena) -> Outcome:
    name = "shell_remount_read_write"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    target = arena.outside / "after-remount"
    result = await arena.shell(f"mount -o remount,rw / && touch {target}")
    escapes = [f"remounted / and wrote {target}"] if target.exists() else []
    return outcome(name, escapes, f"remount refused: {_first_line(result.output)}")


async def read_secret_files(arena: Arena) -> Outcome:
    name = "shell_read_secret_files"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    home = arena.home
    result = await arena.shell(
        f"cat {home}/.ssh/id_ed25519 {home}/.aws/credentials {home}/.netrc "
        f"{home}/.config/gh/hosts.yml; grep -r secret {home}; "
        f"find {home} -type f -exec cat {{}} +; head -c 300 /etc/shadow"
    )
    escapes = [f"read {relative}" for relative in arena.leaked_tokens(result.output)]
    if SHADOW_LINE.search(result.output):
        escapes.append("read /etc/shadow")
    return outcome(name, escapes, "the home's credential files and /etc/shadow are covered")


async def read_secret_environment(arena: Arena) -> Outcome:
    name = "shell_read_secret_environment"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    token = arena.tokens[".netrc"] + "-env"
    previous = os.environ.get("ONCE_ESCAPE_API_TOKEN")
    os.environ["ONCE_ESCAPE_API_TOKEN"] = token  # in the harness's own environment
    try:
        result = await arena.shell(
            f"env; cat /proc/*/environ | tr '\\0' '\\n'; cat /proc/{os.getpid()}/environ"
        )
    finally:
        if previous is None:
            del os.environ["ONCE_ESCAPE_API_TOKEN"]
        else:
            os.environ["ONCE_ESCAPE_API_TOKEN"] = previous
    escapes = ["read the harness's API token"] if token in result.output else []
    return outcome(name, escapes, "credential variables are not passed; /proc shows the sandbox")


async def loopback_tcp(arena: Arena) -> Outcome:
    name = "shell_network_loopback"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        result = await arena.shell(
            f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo escaped >&3 && echo connected"
        )
        escapes = _accepted(server, f"127.0.0.1:{port}")
    return outcome(name, escapes, f"no connection: {_first_line(result.output)}")


async def unix_sockets(arena: Arena) -> Outcome:
    name = "shell_unix_sockets"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    python = _python_inside()
    if python is None:
        why = "no Python interpreter outside /tmp to make the attempt with"
        return Outcome(name, False, why, why)
    path = str(arena.outside / f"daemon-{marker()}.sock")
    abstract = f"\0once-escape-{marker()}"
    with socket.socket(socket.AF_UNIX) as on_path, socket.socket(socket.AF_UNIX) as on_abstract:
        for server, address in ((on_path, path), (on_abstract, abstract)):
            server.bind(address)
            server.listen()
            server.setblocking(False)
        program = (
            "import socket\n"
            f"for address in ({path!r}, {abstract!r}):\n"
            "    try:\n"
            "        s = socket.socket(socket.AF_UNIX); s.connect(address); s.send(b'x')\n"
            "        print('connected', repr(address))\n"
            "    except OSError as e:\n"
            "        print('refused', repr(address), e)\n"
        )
        result = await arena.shell(f"{python} -c {shlex.quote(program)}")
        escapes = _accepted(on_path, path) + _accepted(on_abstract, "an abstract socket")
    return outcome(name, escapes, f"socket(AF_UNIX) refused: {_first_line(result.output)}")


async def signal_host_process(arena: Arena) -> Outcome:
    name = "shell_signal_host_process"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    victim = await asyncio.create_subprocess_exec("sleep", marker())
    try:
        result = await arena.shell(f"kill -9 {victim.pid}")
        escapes = [] if is_alive(victim.pid) else [f"killed host process {victim.pid}"]
    finally:
        if victim.returncode is None:
            victim.kill()
        await victim.wait()
    return outcome(name, escapes, f"host processes are invisible: {_first_line(result.output)}")


async def process_left_running(arena: Arena) -> Outcome:
    name = "shell_process_left_running"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    markers = [marker() for _ in range(3)]
    await arena.shell(
        f"setsid sleep {markers[0]} > /dev/null 2>&1 < /dev/null & "
        f"nohup sh -c 'trap \"\" HUP TERM; exec sleep {markers[1]}' > /dev/null 2>&1 & "
        f"(sleep {markers[2]} &); disown -a; echo started"
    )
    survivors = [m for m in markers if not await _vanish(f"sleep {m}")]
    escapes = [f"sleep {m} outlived the call" for m in survivors]
    return outcome(name, escapes, "setsid, nohup with ignored signals, double fork: all killed")


async def process_left_running_escalated(arena: Arena) -> Outcome:
    # The user approved running outside the sandbox: no PID namespace holds the command,
    # and a process that left its session escapes the process-group kill.
    name = "shell_process_left_running_escalated"
    if why := arena.unsupported_shell() or _no_limits(arena, "pids"):
        return Outcome(name, False, why, why)
    leftover = marker()
    ctx = arena.context()
    ctx.policy, ctx.approve = ApprovalPolicy("on-request"), lambda _name, _args: True
    args = {
        "command": f"setsid sleep {leftover} > /dev/null 2>&1 < /dev/null & echo started",
        "with_escalated_permissions": True,
        "justification": "an escape attempt",
    }
    result = await arena.registry.call("shell", args, ctx)
    if result.metadata.get("sandbox") != "none":
        return Outcome(name, False, f"the escalated run did not run: {result.output[:160]}")
    escapes = [] if await _vanish(f"sleep {leftover}") else ["setsid sleep outlived the call"]
    return outcome(name, escapes, "outside the sandbox, the call's cgroup still killed it")


async def fork_bomb(arena: Arena) -> Outcome:
    name = "shell_fork_bomb"
    if why := arena.unsupported_shell() or _no_limits(arena, "pids"):
        return Outcome(name, False, why, why)
    limit = _limit(arena, "max_processes")
    # First a loop of a fixed size, three times the limit: it must hit the limit.
    bounded = marker()
    loop = (
        f"sh -c 'i=0; while [ $i -lt {3 * limit} ]; do sleep {bounded} & i=$((i+1)); done; "
        "echo spawned $i'"
    )
    result, peak = await _sampled(arena, loop, f"sleep {bounded}", timeout_ms=20_000)
    left = not await _vanish(f"sleep {bounded}")
    if f"spawned {3 * limit}" in result.output or not _fork_failed(result.output) or left:
        return Outcome(name, False, f"a bounded loop of {3 * limit} forks was not held back")
    # Then the real bomb, which only the limit (and the call's timeout) stops. The shell
    # that starts it stays (the sleep), else the sandbox ends with it and takes the
    # bomb along before it reaches the limit.
    bomb = marker()
    command = f": {bomb}; bomb() {{ bomb | bomb & }}; bomb; sleep 600"
    result, bomb_peak = await _sampled(arena, command, bomb, timeout_ms=3_000)
    escapes = []
    if bomb_peak > limit:
        escapes.append(f"{bomb_peak} bomb processes at once (limit {limit})")
    if not await _vanish(bomb):
        escapes.append("bomb processes outlived the call")
    detail = (
        f"a bounded loop stopped at the limit (peak {peak}); the bomb peaked at {bomb_peak} "
        f"of {limit} processes and was killed with the call (exit {_exit_code(result)})"
    )
    return outcome(name, escapes, detail)


async def memory_bomb(arena: Arena) -> Outcome:
    name = "shell_memory_bomb"
    if why := arena.unsupported_shell() or _no_limits(arena, "memory"):
        return Outcome(name, False, why, why)
    size = 2 * _limit(arena, "max_memory_bytes")
    result = await arena.shell(f"x=$(head -c {size} /dev/zero | tr '\\0' x); echo got ${{#x}}")
    escapes = [f"held {size} bytes over a {size // 2} byte limit"] if "got" in result.output else []
    return outcome(name, escapes, f"killed at the memory limit (exit {_exit_code(result)})")


async def hard_link_out(arena: Arena) -> Outcome:
    name = "shell_hard_link_out"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    target = arena.outside / "linked.txt"
    target.write_text("original\n")
    result = await arena.shell(f"ln {target} hard.txt && echo changed > hard.txt")
    escapes = [] if target.read_text() == "original\n" else [f"changed {target} via a hard link"]
    return outcome(name, escapes, f"no link across the mount: {_first_line(result.output)}")


SHELL_ATTEMPTS = [
    Attempt("shell_write_outside", write_outside),
    Attempt("shell_remount_read_write", remount_read_write),
    Attempt("shell_read_secret_files", read_secret_files),
    Attempt("shell_read_secret_environment", read_secret_environment),
    Attempt("shell_network_loopback", loopback_tcp),
    Attempt("shell_unix_sockets", unix_sockets),
    Attempt("shell_signal_host_process", signal_host_process),
    Attempt("shell_process_left_running", process_left_running),
    Attempt("shell_process_left_running_escalated", process_left_running_escalated),
    Attempt("shell_fork_bomb", fork_bomb),
    Attempt("shell_memory_bomb", memory_bomb),
    Attempt("shell_hard_link_out", hard_link_out),
]


async def _sampled(arena: Arena, command: str, needle: str, timeout_ms: int):
    """Run `command`, counting the processes matching `needle` meanwhile: (result, peak)."""
    peak = 0

    async def sample():
        nonlocal peak
        while True:
            peak = max(peak, len(processes_with(needle)))
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    try:
        result = await arena.shell(command, timeout_ms=timeout_ms)
    finally:
        sampler.cancel()
    return result, peak


async def _vanish(needle: str) -> bool:
    """True once no process matches `needle`; False if some still does after the guard."""
    for _ in range(int(HANG_GUARD_S / 0.02)):
        if not processes_with(needle):
            return True
        await asyncio.sleep(0.02)
    return False


def _accepted(server: socket.socket, what: str) -> list[str]:
    try:
        connection, _ = server.accept()
    except BlockingIOError:
        return []
    connection.close()
    return [f"connected to {what} on the host"]


def _fork_failed(output: str) -> bool:
    return any(failure in output for failure in FORK_FAILURES)


def _limit(arena: Arena, name: str) -> int:
    cgroups = arena.sandbox.cgroups
    value = getattr(cgroups.limits, name) if cgroups is not None else None
    if not isinstance(value, int):
        raise ValueError(f"the arena's sandbox has no {name}")
    return value


def _no_limits(arena: Arena, kind: str) -> str | None:
    """Why this host cannot bound `kind` ("pids" or "memory"), or None."""
    cgroups = arena.sandbox.cgroups
    if cgroups is None or all(c.name != kind for c in cgroups.controllers):
        return "; ".join(arena.sandbox.gaps) or f"no {kind} cgroup here"
    return None


def _python_inside() -> str | None:
    # The interpreter behind a venv: a venv under /tmp is hidden by the private /tmp.
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        if os.path.exists(candidate) and not candidate.startswith("/tmp/"):
            return candidate
    return None


def _exit_code(result: ToolResult) -> object:
    return result.metadata.get("exit_code")


def _first_line(text: str) -> str:
    """The command's first line of output (after the tool's own header lines)."""
    output = text.split("Output:\n", 1)[-1]
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[0][:160] if lines else "(no output)"
