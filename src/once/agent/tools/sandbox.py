"""Where shell commands run: a bubblewrap sandbox when it works here, else plainly unsandboxed.

`Sandbox().wrap(argv, workspace)` prefixes a command with bubblewrap so that it sees the
whole file system read-only, the workspace writable, a private `/tmp`, no network (a new
network namespace: only its own loopback, on which nothing listens), its own PID namespace
(killing bubblewrap kills every process the command started), and no capabilities.
`Sandbox.confined(...)` adds what needs a resource per call (the shell tool uses it):
credentials hidden and Unix sockets refused (sandbox_rules.py), and a cgroup bounding the
command's processes and memory (command_limits.py). What cannot be enforced here is
listed in `gaps` and in `describe()`.

The mount order matters: `--tmpfs /tmp` comes before the workspace bind, so a workspace
under `/tmp` stays visible. `--cap-drop ALL` matters when the harness runs as root: with
its capabilities a command could `mount -o remount,rw /` inside the sandbox and then write
anywhere, through the bind, to the real file system (checked here, bwrap 0.8.0).

bubblewrap is probed once per binary: a sandbox that does not start (binary missing, user
namespaces disabled) gives mode "none" and a `reason` the CLI prints, never a silent
downgrade. `NoSandbox` is the explicit "danger-full-access" choice.
"""

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from once.agent.tools.command_limits import CgroupLimits, CommandLimits, LimitCell
from once.agent.tools.sandbox_rules import (
    filter_fd,
    hiding_flags,
    secret_paths,
    unix_socket_filter,
)

BUBBLEWRAP = "bubblewrap"
NONE = "none"

# Isolation flags, verified one by one with bwrap 0.8.0 as root on this machine.
ISOLATION_FLAGS = (
    "--unshare-net",  # no network: a fresh namespace, even loopback is a different one
    "--unshare-pid",  # bwrap is PID 1 of the command's processes: they die with it
    "--unshare-ipc",
    "--unshare-uts",
    "--cap-drop",
    "ALL",  # as root, capabilities would allow remounting / read-write
    "--die-with-parent",  # a killed harness (or a timeout) takes the command with it
    "--new-session",  # no TIOCSTI keystroke injection into the harness's terminal
)

# Output that a command denied by the sandbox typically prints: the `on-failure` policy
# offers an unsandboxed retry only for these, not for every non-zero exit (a `grep` with
# no match is not the sandbox's fault).
DENIAL_MARKERS = (
    "read-only file system",
    "permission denied",
    "operation not permitted",
    "network is unreachable",
    "connection refused",
    "temporary failure in name resolution",
    "could not resolve host",
    "name or service not known",
)


@dataclass(frozen=True)
class Launch:
    """A confined command: its argv and the descriptors it needs open (the seccomp filter)."""

    argv: list[str]
    pass_fds: tuple[int, ...] = ()


class Sandbox:
    """bubblewrap if it starts here; otherwise mode "none" with the reason why.

    `limits` bound each command's processes and memory (default: `CommandLimits()`; a
    field of None is no limit of that kind); `home` is whose credentials are hidden
    (default: this user's home directory)."""

    def __init__(
        self,
        bwrap: str | None = None,
        *,
        limits: CommandLimits | None = None,
        home: str | Path | None = None,
    ):
        self.bwrap = bwrap or shutil.which("bwrap")
        self.home = Path(home) if home is not None else Path.home()
        self.socket_filter: bytes | None = None
        self.cgroups: CgroupLimits | None = None
        self.gaps: list[str] = []
        if self.bwrap is None:
            self.mode, self.reason = NONE, "bwrap not found (install the bubblewrap package)"
            return
        self.mode, self.reason = _probe_bubblewrap(self.bwrap)
        if not self.enforced:
            return
        self.socket_filter, why = unix_socket_filter()
        if self.socket_filter is not None and not _probe_seccomp(self.bwrap, self.socket_filter):
            self.socket_filter, why = None, f"bwrap at {self.bwrap} refused the seccomp filter"
        if why:
            self.gaps.append(f"Unix sockets reachable: {why}")
        limits = limits if limits is not None else CommandLimits()
        if limits.max_processes is None and limits.max_memory_bytes is None:
            return  # no limits were asked for: none is missing
        cgroups = CgroupLimits(limits)
        self.gaps += cgroups.missing
        self.cgroups = cgroups if cgroups.controllers else None

    @property
    def enforced(self) -> bool:
        return self.mode == BUBBLEWRAP

    def wrap(
        self,
        argv: list[str],
        workspace: str | Path,
        *,
        workdir: str | Path | None = None,
        writable_roots: tuple[str | Path, ...] = (),
        seccomp_fd: int | None = None,
    ) -> list[str]:
        """The command line that runs `argv` confined to `workspace` (and `writable_roots`),
        with the credentials hidden and, given `seccomp_fd`, that filter installed."""
        if not argv:
            raise ValueError("empty command")
        if not self.enforced:
            return list(argv)
        if self.bwrap is None:  # enforced only after a probe of a bwrap that was found
            raise RuntimeError("sandbox mode is bubblewrap but no bwrap binary is set")
        roots = [_writable_root(workspace), *(_writable_root(r) for r in writable_roots)]
        chdir = Path(workdir).resolve() if workdir is not None else roots[0]
        # Credentials are looked up at each call (a login made after start is hidden too).
        # One outside every writable root is covered before the binds (a workspace inside
        # it stays visible); one inside a root, after (a home used as the workspace does
        # not show its ~/.ssh).
        hidden = [p for p in secret_paths(self.home) if not p.is_relative_to("/tmp")]
        inside = [p for p in hidden if any(p.is_relative_to(root) for root in roots)]
        return [
            self.bwrap,
            *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"),
            *hiding_flags([p for p in hidden if p not in inside]),
            *(flag for root in roots for flag in ("--bind", str(root), str(root))),
            *hiding_flags(inside),
            *ISOLATION_FLAGS,
            *(("--seccomp", str(seccomp_fd)) if seccomp_fd is not None else ()),
            *("--chdir", str(chdir)),
            "--",
            *argv,
        ]

    @contextlib.asynccontextmanager
    async def confined(
        self,
        argv: list[str],
        workspace: str | Path,
        *,
        workdir: str | Path | None = None,
        sandboxed: bool = True,
    ) -> AsyncIterator[Launch]:
        """`wrap` with this call's resources: the seccomp filter's descriptor and a cgroup,
        entered before the command runs; at the end whatever is left in it is killed.
        `sandboxed=False` (a run the user approved outside the sandbox) keeps the cgroup
        only: the command's processes are still bounded and still end with the call."""
        if not self.enforced:
            yield Launch(list(argv))
            return
        fd = None
        if sandboxed and self.socket_filter is not None:
            fd = filter_fd(self.socket_filter)
        cell: LimitCell | None = None
        try:
            wrapped = (
                self.wrap(argv, workspace, workdir=workdir, seccomp_fd=fd)
                if sandboxed
                else list(argv)
            )
            if self.cgroups is not None:
                cell = self.cgroups.cell()
                wrapped = cell.launcher(wrapped)
            yield Launch(wrapped, (fd,) if fd is not None else ())
        finally:
            if fd is not None:
                os.close(fd)
            if cell is not None:
                await cell.remove()

    def describe(self) -> str:
        if self.enforced:
            text = "sandbox: bubblewrap (workspace writable, rest read-only, no network)"
            return "; ".join([text, *self.gaps])
        return f"sandbox: none ({self.reason}); commands can write anywhere and use the network"


class NoSandbox(Sandbox):
    """danger-full-access: commands run as the harness itself does."""

    def __init__(self):
        self.bwrap = None
        self.mode, self.reason = NONE, "danger-full-access was chosen"
        self.home, self.socket_filter, self.cgroups, self.gaps = Path.home(), None, None, []


@functools.cache
def default_sandbox() -> Sandbox:
    """The sandbox a shell call uses when the harness configured none: probed once."""
    return Sandbox()


def looks_like_sandbox_denial(output: str) -> bool:
    lowered = output.lower()
    return any(marker in lowered for marker in DENIAL_MARKERS)


def _writable_root(path: str | Path) -> Path:
    root = Path(path).resolve()
    if root == Path("/"):
        raise ValueError("the workspace cannot be / (that would make everything writable)")
    if not root.is_dir():
        raise ValueError(f"workspace {str(root)!r} is not a directory")
    return root


@functools.cache
def _probe_bubblewrap(bwrap: str) -> tuple[str, str]:
    # Run the real flags once: a binary that exists may still fail (no user namespaces
    # for an unprivileged user, a seccomp profile that forbids unshare). The command
    # writes one file into a bound directory, which proves the bind works too.
    with tempfile.TemporaryDirectory(prefix="once-sandbox-probe-") as probe_dir:
        argv = [
            bwrap,
            *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"),
            *("--bind", probe_dir, probe_dir),
            *ISOLATION_FLAGS,
            *("--chdir", probe_dir),
            "--",
            "/bin/sh",
            "-c",
            ": > probe",
        ]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return NONE, f"bwrap at {bwrap} did not run: {e}"
        if done.returncode != 0:
            detail = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            return NONE, f"bwrap at {bwrap} failed: {detail[0]}"
        if not (Path(probe_dir) / "probe").exists():
            return NONE, f"bwrap at {bwrap} ran but the workspace bind did not work"
    return BUBBLEWRAP, f"bubblewrap ({bwrap})"


@functools.cache
def _probe_seccomp(bwrap: str, program: bytes) -> bool:
    fd = filter_fd(program)
    try:
        argv = [bwrap, "--ro-bind", "/", "/", "--seccomp", str(fd), "--", "/bin/sh", "-c", ":"]
        done = subprocess.run(argv, capture_output=True, pass_fds=(fd,), timeout=10)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        os.close(fd)
