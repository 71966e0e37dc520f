"""The bubblewrap sandbox, for real: these tests fail (not skip) as root without bwrap.

The project's set-up installs bubblewrap (apt-get install bubblewrap) and CI runs as root,
so a missing sandbox there is a broken set-up, not an optional feature. Elsewhere (not
root, cannot install it) they skip with the probe's reason.
"""

import asyncio
import os
import socket
import tempfile
from pathlib import Path

import pytest

from once.agent.tools.base import ToolContext
from once.agent.tools.sandbox import ISOLATION_FLAGS, NoSandbox, Sandbox
from once.agent.tools.shell import ShellTool

REPO = Path(__file__).resolve().parents[2]


def require_bubblewrap() -> Sandbox:
    sandbox = Sandbox()
    if sandbox.enforced:
        return sandbox
    message = f"bubblewrap sandbox unavailable: {sandbox.reason}"
    if os.geteuid() == 0:
        pytest.fail(f"{message}; running as root, the set-up must install it (bubblewrap)")
    pytest.skip(f"{message}; not root, so it cannot be installed here")


@pytest.fixture
def sandbox() -> Sandbox:
    return require_bubblewrap()


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def outside():
    # Not under /tmp: the sandbox gives /tmp a private tmpfs, so a directory there would
    # merely be invisible; /var/tmp is the read-only real file system inside.
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="once-outside-") as path:
        yield Path(path)


async def run(sandbox: Sandbox, workspace: Path, command: str, timeout_ms: int = 10_000):
    ctx = ToolContext(workspace=workspace, sandbox=sandbox)
    return await ShellTool(login_shell=False)({"command": command, "timeout_ms": timeout_ms}, ctx)


async def test_writes_only_inside_the_workspace(sandbox, workspace, outside):
    repo_file = REPO / "tests" / "agent" / "sandbox-escape.txt"
    result = await run(
        sandbox,
        workspace,
        f"echo in > inside.txt; touch {outside}/x; touch {repo_file}; touch /root/once-x; "
        "echo done",
    )
    assert (workspace / "inside.txt").read_text() == "in\n"
    assert not (outside / "x").exists()
    assert not repo_file.exists()
    assert not Path("/root/once-x").exists()
    # A repository under /tmp (CI's clones) is hidden by the sandbox's private /tmp:
    # that touch fails with "No such file or directory" instead.
    denials = result.output.count("Read-only file system")
    hidden = str(REPO).startswith(tempfile.gettempdir())
    assert denials == (2 if hidden else 3)
    assert result.metadata["sandbox"] == "bubblewrap"


async def test_remounting_read_write_does_not_escape(sandbox, workspace, outside):
    # As root, without --cap-drop ALL, this remount succeeds and the touch writes through.
    result = await run(sandbox, workspace, f"mount -o remount,rw / ; touch {outside}/escaped")
    assert result.is_error
    assert not (outside / "escaped").exists()


async def test_tmp_is_private(sandbox, workspace):
    marker = Path(tempfile.gettempdir()) / f"once-sandbox-{os.getpid()}-{id(workspace)}"
    result = await run(sandbox, workspace, f"echo x > {marker} && cat {marker}")
    assert not result.is_error and "x" in result.output
    assert not marker.exists()


async def test_no_network_not_even_loopback(sandbox, workspace):
    # A real listener on this machine's loopback: reachable unsandboxed, not from inside.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        # bash's /dev/tcp: no interpreter needed (a venv under /tmp is hidden inside).
        connect = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"
        inside = await run(sandbox, workspace, connect)
        unsandboxed = await run(NoSandbox(), workspace, connect)
    assert inside.is_error and "connected" not in inside.output
    assert "Connection refused" in inside.output
    assert not unsandboxed.is_error and "connected" in unsandboxed.output


async def test_cannot_see_or_signal_host_processes(sandbox, workspace):
    result = await run(sandbox, workspace, f"kill -0 {os.getpid()}")
    assert result.is_error
    unsandboxed = await run(NoSandbox(), workspace, f"kill -0 {os.getpid()}")
    assert not unsandboxed.is_error


async def test_timeout_kills_everything_in_the_sandbox(sandbox, workspace):
    marker = "97.3125"  # a sleep length no other process uses
    result = await run(sandbox, workspace, f"sleep {marker} & sleep {marker}", timeout_ms=300)
    assert result.metadata["timed_out"] and result.metadata["exit_code"] == 124
    assert await no_process_with(f"sleep {marker}")


def test_wrap_mount_order_and_flags(sandbox, workspace):
    argv = sandbox.wrap(["ls", "-la"], workspace, workdir=workspace)
    assert argv[-3:] == ["--", "ls", "-la"]
    # /tmp's tmpfs must come before the workspace bind, or a workspace in /tmp vanishes.
    assert argv.index("--tmpfs") < argv.index("--bind")
    assert argv[argv.index("--bind") + 1 : argv.index("--bind") + 3] == [str(workspace)] * 2
    for flag in ISOLATION_FLAGS:
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"


@pytest.mark.parametrize("bad", ["/", "missing"])
def test_wrap_refuses_a_bad_workspace(sandbox, workspace, bad):
    with pytest.raises(ValueError):
        sandbox.wrap(["ls"], bad if bad == "/" else workspace / bad)
    with pytest.raises(ValueError, match="empty"):
        sandbox.wrap([], workspace)


@pytest.mark.parametrize("bwrap", ["/nonexistent/bwrap", "/bin/false"])
def test_a_broken_bwrap_is_reported_not_used(bwrap, workspace):
    weak = Sandbox(bwrap=bwrap)
    assert weak.mode == "none" and not weak.enforced
    assert bwrap in weak.reason
    assert weak.wrap(["ls"], workspace) == ["ls"]
    assert "sandbox: none" in weak.describe() and bwrap in weak.describe()


def test_no_sandbox_is_explicit():
    full = NoSandbox()
    assert full.mode == "none" and "danger-full-access" in full.reason
    assert full.wrap(["ls", "-l"], "/") == ["ls", "-l"]


async def no_process_with(text: str, wait_s: float = 3.0) -> bool:
    needle = text.replace(" ", "\0").encode()
    for _ in range(int(wait_s / 0.05)):
        alive = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if needle in cmdline.read_bytes():
                    alive.append(cmdline)
            except OSError:
                pass
        if not alive:
            return True
        await asyncio.sleep(0.05)
    return False
