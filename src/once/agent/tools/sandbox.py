"""Where shell commands run: a bubblewrap sandbox when it works here, else plainly unsandboxed.

`Sandbox().wrap(argv, workspace)` prefixes a command with bubblewrap so that it sees the
whole file system read-only, the workspace writable, a private `/tmp`, no network (a new
network namespace: only its own loopback, on which nothing listens), its own PID namespace
(killing bubblewrap kills every process the command started), and no capabilities.

The mount order matters: `--tmpfs /tmp` comes before the workspace bind, so a workspace
under `/tmp` stays visible. `--cap-drop ALL` matters when the harness runs as root: with
its capabilities a command could `mount -o remount,rw /` inside the sandbox and then write
anywhere, through the bind, to the real file system (checked here, bwrap 0.8.0).

bubblewrap is probed once per binary: a sandbox that does not start (binary missing, user
namespaces disabled) gives mode "none" and a `reason` the CLI prints, never a silent
downgrade. `NoSandbox` is the explicit "danger-full-access" choice.
"""

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

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


class Sandbox:
    """bubblewrap if it starts here; otherwise mode "none" with the reason why."""

    def __init__(self, bwrap: str | None = None):
        self.bwrap = bwrap or shutil.which("bwrap")
        if self.bwrap is None:
            self.mode, self.reason = NONE, "bwrap not found (install the bubblewrap package)"
        else:
            self.mode, self.reason = _probe_bubblewrap(self.bwrap)

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
    ) -> list[str]:
        """The command line that runs `argv` confined to `workspace` (and `writable_roots`)."""
        if not argv:
            raise ValueError("empty command")
        if not self.enforced:
            return list(argv)
        if self.bwrap is None:  # enforced only after a probe of a bwrap that was found
            raise RuntimeError("sandbox mode is bubblewrap but no bwrap binary is set")
        roots = [_writable_root(workspace), *(_writable_root(r) for r in writable_roots)]
        chdir = Path(workdir).resolve() if workdir is not None else roots[0]
        return [
            self.bwrap,
            *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"),
            *(flag for root in roots for flag in ("--bind", str(root), str(root))),
            *ISOLATION_FLAGS,
            *("--chdir", str(chdir)),
            "--",
            *argv,
        ]

    def describe(self) -> str:
        if self.enforced:
            return "sandbox: bubblewrap (workspace writable, rest read-only, no network)"
        return f"sandbox: none ({self.reason}); commands can write anywhere and use the network"


class NoSandbox(Sandbox):
    """danger-full-access: commands run as the harness itself does."""

    def __init__(self):
        self.bwrap = None
        self.mode, self.reason = NONE, "danger-full-access was chosen"


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
