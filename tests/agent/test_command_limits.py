"""A cgroup per command: its processes are in it from the start, bounded, and killed at the end.

These run the launcher and the cgroup for real, without the sandbox, where a process can
leave its session: only the cgroup still holds it. They skip where this host gives no
writable cgroup (the sandbox then reports the gap; test_reliability_sandbox.py's bombs
skip the same way).
"""

import asyncio

import pytest

from once.agent.tools.command_limits import CgroupLimits, CommandLimits
from once.agent.tools.sandbox import Sandbox
from once.bench.reliability.sandbox_arena import marker, processes_with


@pytest.fixture
def cgroups() -> CgroupLimits:
    cgroups = CgroupLimits(CommandLimits(max_processes=16, max_memory_bytes=64 << 20))
    if {c.name for c in cgroups.controllers} != {"pids", "memory"}:
        pytest.skip("; ".join(cgroups.missing))
    return cgroups


async def appears(command: str, within_s: float = 30.0) -> list[int]:
    """The processes running `command`, waited for: a process in the middle of its exec has
    an empty command line for a moment, and the background `setsid` may not have run yet."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not (found := processes_with(command)):
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.02)
    return found


async def run(argv: list[str]) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)  # a hang guard
    return out.decode()


async def test_a_process_that_left_its_session_is_killed_with_the_cell(cgroups):
    cell = cgroups.cell()
    leftover = marker()
    try:
        output = await run(
            cell.launcher(
                ["sh", "-c", f"setsid sleep {leftover} >/dev/null 2>&1 & cat /proc/self/cgroup"]
            )
        )
        assert all(path.name in output for path in cell.paths)
        assert await appears(f"sleep {leftover}")  # alive: it left the process group
        assert set(cell.pids()) >= set(processes_with(f"sleep {leftover}"))
    finally:
        paths = list(cell.paths)
        await cell.remove()
    assert not processes_with(f"sleep {leftover}")
    assert not any(path.exists() for path in paths)


async def test_forks_past_the_process_limit_fail(cgroups):
    cell = cgroups.cell()
    sleeper = marker()
    try:
        # The sleeps must not hold the pipe open: only the cgroup kills them here.
        loop = (
            f"i=0; while [ $i -lt 48 ]; do sleep {sleeper} >/dev/null 2>&1 & i=$((i+1)); done; "
            "echo spawned $i"
        )
        proc = await asyncio.create_subprocess_exec(
            *cell.launcher(["sh", "-c", loop]),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await cell.remove()
    assert "spawned 48" not in out.decode() and "Cannot fork" in out.decode()
    assert len(processes_with(f"sleep {sleeper}")) == 0


def test_limits_reject_nonsense_and_none_means_no_cgroup():
    with pytest.raises(ValueError, match="max_processes"):
        CommandLimits(max_processes=0)
    with pytest.raises(ValueError, match="max_memory_bytes"):
        CommandLimits(max_memory_bytes=-1)
    unlimited = Sandbox(limits=CommandLimits(max_processes=None, max_memory_bytes=None))
    assert unlimited.cgroups is None
    assert not any("limit" in gap for gap in unlimited.gaps)
