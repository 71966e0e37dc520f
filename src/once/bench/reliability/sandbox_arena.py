"""Where an escape attempt runs, and how its outcome is judged on the host.

An `Arena` is a scratch directory under /var/tmp with a workspace, a directory outside it
and a home directory holding fake credentials (random tokens), and the real tools around
them: the `shell` tool under a real `Sandbox` (bubblewrap, its seccomp filter and a
cgroup with small limits, so a bomb costs little), `apply_patch`, and Code Mode over both.
Not under /tmp: the sandbox gives /tmp a private tmpfs, so a file there would merely be
invisible to the command, never protected.

Every attempt is judged by what the host sees afterwards (the file outside does not
exist, the token is not in the output, the listener got no connection, no process with
the attempt's marker is alive in /proc), never by timing.
"""

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from once.agent.tools.base import ToolContext, ToolResult
from once.agent.tools.code_mode import CodeModeLimits, CodeModeTool
from once.agent.tools.command_limits import CommandLimits
from once.agent.tools.patch import ApplyPatchTool
from once.agent.tools.registry import ToolRegistry
from once.agent.tools.sandbox import Sandbox
from once.agent.tools.shell import ShellTool

# Small enough that a bomb is cheap, large enough for bash, bwrap and a few helpers.
ARENA_LIMITS = CommandLimits(max_processes=64, max_memory_bytes=128 << 20)
SCRATCH_PARENT = Path("/var/tmp")


@dataclass(frozen=True)
class Outcome:
    """`unsupported`: this host cannot hold the attempt back (no bwrap, no cgroup); the
    attempt counts as an escape, and the reason says what the host lacks."""

    name: str
    blocked: bool
    detail: str
    unsupported: str | None = None


@dataclass(frozen=True)
class Attempt:
    name: str
    run: Callable[["Arena"], Awaitable[Outcome]]


class Arena:
    def __init__(self, root: Path, limits: CommandLimits = ARENA_LIMITS):
        self.root = root
        self.workspace = root / "workspace"
        self.outside = root / "outside"
        self.home = root / "home"
        self.tokens = {  # fake credential files under the home, each with its token
            ".ssh/id_ed25519": f"ssh-{secrets.token_hex(16)}",
            ".aws/credentials": f"aws-{secrets.token_hex(16)}",
            ".netrc": f"netrc-{secrets.token_hex(16)}",
            ".config/gh/hosts.yml": f"gh-{secrets.token_hex(16)}",
        }
        for directory in (self.workspace, self.outside, self.home):
            directory.mkdir()
        for relative, token in self.tokens.items():
            path = self.home / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"secret {token}\n")
        # The arena's sandbox hides the arena's home: the real policy (which paths under a
        # home hold credentials), pointed at fake ones.
        self.sandbox = Sandbox(limits=limits, home=self.home)
        self.shell_tool = ShellTool(login_shell=False)
        self.registry = ToolRegistry(
            [CodeModeTool(limits=CodeModeLimits(timeout_s=20)), self.shell_tool, ApplyPatchTool()]
        )

    def context(self) -> ToolContext:
        return ToolContext(workspace=self.workspace, sandbox=self.sandbox, registry=self.registry)

    async def shell(self, command: str, timeout_ms: int = 20_000) -> ToolResult:
        return await self.shell_tool({"command": command, "timeout_ms": timeout_ms}, self.context())

    async def patch(self, text: str) -> ToolResult:
        return await self.registry.call("apply_patch", {"input": text}, self.context())

    async def code(self, program: str) -> ToolResult:
        return await self.registry.call("code", {"code": program}, self.context())

    def leaked_tokens(self, text: str) -> list[str]:
        return [name for name, token in self.tokens.items() if token in text]

    def unsupported_shell(self) -> str | None:
        """Why shell attempts cannot be held back here, or None."""
        if not self.sandbox.enforced:
            return f"no bubblewrap sandbox: {self.sandbox.reason}"
        return None


@contextlib.asynccontextmanager
async def arena(limits: CommandLimits = ARENA_LIMITS):
    root = Path(tempfile.mkdtemp(prefix="once-escape-", dir=SCRATCH_PARENT))
    try:
        yield Arena(root, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def marker() -> str:
    """A number no other process has on its command line: `sleep <marker>` is findable."""
    return f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(10**6):06d}"


def processes_with(text: str) -> list[int]:
    """Live processes whose command line contains `text` (arguments joined by spaces)."""
    needle = text.encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:  # a zombie's command line is empty: only live processes match
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


def is_alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped, not gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def outcome(name: str, escapes: list[str], blocked_detail: str) -> Outcome:
    """Blocked when nothing escaped; otherwise the detail lists what did."""
    if escapes:
        return Outcome(name, False, "; ".join(escapes))
    return Outcome(name, True, blocked_detail)
