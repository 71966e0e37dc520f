"""The `shell` tool: one command, in the workspace, in the sandbox, with a timeout.

A string command runs as `bash -lc COMMAND`; an argv runs as given. stdout and stderr
share one pipe, so the model sees them interleaved as a terminal would. Output is kept as
a head and a tail of a byte budget while it streams (a `yes` cannot fill memory) and the
middle is replaced by a marker saying how much was cut. The command runs in its own
process group (and, sandboxed, its own PID namespace and cgroup); at a timeout, when the
command exits, or when the call is cancelled, the whole group is killed (sandboxed: the
namespace and whatever is left in the cgroup), so no process outlives its call.

Whether this call is sandboxed is the policy's decision (`ApprovalPolicy.take_decision`);
under `on-failure` a sandboxed run that fails like a sandbox denial is offered to the user
for one unsandboxed retry.
"""

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.sandbox import Sandbox, default_sandbox, looks_like_sandbox_denial

DEFAULT_TIMEOUT_MS = 10_000
MAX_TIMEOUT_MS = 600_000
DEFAULT_MAX_OUTPUT_BYTES = 10_000  # about 2,500 tokens
TIMEOUT_EXIT_CODE = 124  # what coreutils `timeout` reports
READ_CHUNK = 65_536
# Variables whose names contain these are not passed to commands: a model's command
# should not read the harness's API keys.
SECRET_ENV_MARKERS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")
DRAIN_GRACE_S = 1.0  # after the group is killed the pipe closes at once; this is a bound

SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ],
            "description": "A bash command line (run with bash -lc), or an argv list.",
        },
        "timeout_ms": {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_TIMEOUT_MS,
            "description": f"Kill the command after this long (default {DEFAULT_TIMEOUT_MS}).",
        },
        "workdir": {
            "type": "string",
            "description": "Directory to run in, relative to the workspace (default: its root).",
        },
        "with_escalated_permissions": {
            "type": "boolean",
            "description": "Ask the user to run this command outside the sandbox.",
        },
        "justification": {
            "type": "string",
            "description": "Why the command needs to run outside the sandbox (for the user).",
        },
    },
    "required": ["command"],
    "additionalProperties": False,
}

SHELL_DESCRIPTION = (
    "Run a shell command in the workspace and return its exit code and output (stdout and "
    "stderr together; long output is cut in the middle). Commands may run in a sandbox "
    "where only the workspace is writable and there is no network; if a command needs more, "
    "set with_escalated_permissions and give a justification."
)


@dataclass
class CommandRun:
    exit_code: int
    output: str
    timed_out: bool
    wall_s: float
    num_output_bytes: int
    num_cut_bytes: int
    timeout_s: float


class HeadTailBuffer:
    """The first and last bytes of a stream, within a budget, and how much there was."""

    def __init__(self, max_bytes: int):
        if max_bytes < 2:
            raise ValueError("max_bytes must be at least 2")
        self.max_bytes = max_bytes
        self.head_limit = max_bytes // 2
        self.tail_limit = max_bytes - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.num_bytes = 0
        self.num_lines = 0

    def feed(self, data: bytes) -> None:
        self.num_bytes += len(data)
        self.num_lines += data.count(b"\n")
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.tail_limit:
            del self.tail[: len(self.tail) - self.tail_limit]

    def render(self) -> tuple[str, int]:
        """(text, number of bytes cut); the cut falls on line ends where that keeps enough."""
        if self.num_bytes <= self.max_bytes:
            return (self.head + self.tail).decode("utf-8", "replace"), 0
        head, tail = bytes(self.head), bytes(self.tail)
        newline = head.rfind(b"\n")
        if newline >= len(head) // 2:
            head = head[: newline + 1]
        newline = tail.find(b"\n")
        if 0 <= newline < len(tail) // 2:
            tail = tail[newline + 1 :]
        num_cut = self.num_bytes - len(head) - len(tail)
        num_cut_lines = self.num_lines - head.count(b"\n") - tail.count(b"\n")
        marker = f"[... {num_cut} bytes ({num_cut_lines} lines) cut of {self.num_bytes} ...]"
        separator = "" if head.endswith(b"\n") or not head else "\n"
        text = f"{head.decode('utf-8', 'replace')}{separator}{marker}\n"
        return text + tail.decode("utf-8", "replace"), num_cut


async def run_command(
    argv: list[str],
    *,
    cwd: Path,
    timeout_s: float,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> CommandRun:
    # The output pipe is ours, not asyncio's: asyncio's Process.wait() returns only once
    # its pipes close, so a background job holding stdout would look like a running command.
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=write_fd,
            stderr=write_fd,
            start_new_session=True,  # its own process group, killed as one
            pass_fds=pass_fds,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    buffer = HeadTailBuffer(max_output_bytes)
    stream = asyncio.StreamReader()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    transport = reader = None
    timed_out = False
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), pipe
        )
        reader = asyncio.create_task(_pump(stream, buffer))
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # leftovers at a normal exit; everything at a timeout or cancel
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        code = await proc.wait()
        if reader is not None:
            try:
                await asyncio.wait_for(reader, DRAIN_GRACE_S)
            except TimeoutError:
                pass  # a process outside the group still holds the pipe; keep what was read
        if transport is not None:
            transport.close()
        else:
            pipe.close()
    output, num_cut = buffer.render()
    exit_code = TIMEOUT_EXIT_CODE if timed_out else (128 - code if code < 0 else code)
    wall_s = time.perf_counter() - start
    return CommandRun(exit_code, output, timed_out, wall_s, buffer.num_bytes, num_cut, timeout_s)


class ShellTool:
    spec = ToolSpec(name="shell", description=SHELL_DESCRIPTION, parameters=SHELL_PARAMETERS)

    def __init__(
        self,
        *,
        default_timeout_ms: int = DEFAULT_TIMEOUT_MS,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        login_shell: bool = True,
        secret_env_markers: tuple[str, ...] = SECRET_ENV_MARKERS,
    ):
        self.default_timeout_ms = default_timeout_ms
        self.max_output_bytes = max_output_bytes
        self.shell_flag = "-lc" if login_shell else "-c"
        self.secret_env_markers = tuple(marker.upper() for marker in secret_env_markers)

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        take = getattr(ctx.policy, "take_decision", None)
        decision = take(args) if take is not None else None  # taken first: never left behind
        command = args["command"]
        argv = ["bash", self.shell_flag, command] if isinstance(command, str) else list(command)
        workspace = Path(ctx.workspace).resolve()
        workdir = (workspace / args.get("workdir", ".")).resolve()
        if not workdir.is_dir():
            return ToolResult(f"workdir {args.get('workdir')!r} is not a directory", True)
        timeout_s = args.get("timeout_ms", self.default_timeout_ms) / 1000
        sandbox: Sandbox = ctx.sandbox if ctx.sandbox is not None else default_sandbox()
        sandboxed = sandbox.enforced and (decision is None or decision.sandboxed)

        try:
            run = await self._run_in(sandbox, sandboxed, argv, workspace, workdir, timeout_s)
            notes = []
            if sandboxed and await self._retry_approved(args, ctx, run):
                notes.append(
                    f"The sandboxed run failed with exit code {run.exit_code}; "
                    "rerun outside the sandbox with the user's approval."
                )
                sandboxed = False
                run = await self._run_in(sandbox, False, argv, workspace, workdir, timeout_s)
        except OSError as e:  # the call's cgroup or filter could not be made
            return ToolResult(f"the sandbox could not be set up for this call: {e}", True)
        return _result(run, sandboxed, sandbox, notes)

    async def _run_in(
        self,
        sandbox: Sandbox,
        sandboxed: bool,
        argv: list[str],
        workspace: Path,
        workdir: Path,
        timeout_s: float,
    ) -> CommandRun:
        # An approved run outside the sandbox still gets the call's cgroup (when the
        # sandbox has one): it runs as the harness does, and still ends with the call.
        confined = sandbox.confined(argv, workspace, workdir=workdir, sandboxed=sandboxed)
        async with confined as launch:
            return await self._run(launch.argv, workdir, timeout_s, launch.pass_fds)

    def command_env(self) -> dict[str, str]:
        """The harness's environment minus what looks like a credential (as Codex does)."""
        return {
            name: value
            for name, value in os.environ.items()
            if not any(marker in name.upper() for marker in self.secret_env_markers)
        }

    async def _run(
        self, argv: list[str], workdir: Path, timeout_s: float, pass_fds: tuple[int, ...] = ()
    ) -> CommandRun:
        try:
            return await run_command(
                argv,
                cwd=workdir,
                timeout_s=timeout_s,
                max_output_bytes=self.max_output_bytes,
                env=self.command_env(),
                pass_fds=pass_fds,
            )
        except OSError as e:  # the program does not exist, is not executable, ...
            return CommandRun(127, f"could not start {argv[0]!r}: {e}", False, 0.0, 0, 0, timeout_s)

    async def _retry_approved(self, args: dict, ctx: ToolContext, run: CommandRun) -> bool:
        retry = getattr(ctx.policy, "approve_unsandboxed_retry", None)
        if retry is None or run.exit_code == 0 or run.timed_out:
            return False
        if not looks_like_sandbox_denial(run.output):
            return False
        return await retry(self.spec, args, ctx, run.output[-2000:])


def _result(run: CommandRun, sandboxed: bool, sandbox: Sandbox, notes: list[str]) -> ToolResult:
    lines = [*notes, f"Exit code: {run.exit_code}"]
    if run.timed_out:
        lines.append(f"Timed out after {run.timeout_s:g} s; the command was killed.")
    lines.append("Output:")
    metadata = {
        "exit_code": run.exit_code,
        "timed_out": run.timed_out,
        "wall_s": round(run.wall_s, 3),
        "sandbox": sandbox.mode if sandboxed else "none",
        "num_output_bytes": run.num_output_bytes,
        "num_cut_bytes": run.num_cut_bytes,
    }
    return ToolResult("\n".join(lines) + "\n" + run.output, run.exit_code != 0, metadata)


async def _pump(stream: asyncio.StreamReader, buffer: HeadTailBuffer) -> None:
    while chunk := await stream.read(READ_CHUNK):
        buffer.feed(chunk)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
