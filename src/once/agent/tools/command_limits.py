"""How many processes and how much memory one sandboxed command may use: a cgroup per call.

A PID namespace hides the host's processes but does not bound how many a command starts,
and RLIMIT_NPROC is never enforced for uid 0 (the kernel exempts root's user), so a fork
bomb run by a harness that runs as root would fill the host's process table. The kernel's
cgroup controllers bound both counts for a whole process tree, root included: each call
gets a fresh cgroup (`pids.max`, and `memory.max` or v1's `memory.limit_in_bytes`), its
command is placed in it before it runs, and at the end every process left in it is
killed and the cgroup removed.

The command enters its cgroup through a launcher, `sh -c 'echo $$ > .../cgroup.procs;
exec "$@"'`, so nothing it forks is ever outside (moving a process after it started would
miss the children it forked first; a `preexec_fn` is unsafe in a process with threads,
and V8 runs on one). Both layouts are found from /proc/self/cgroup and the mount table:
cgroup v1, one hierarchy per controller, and v2, where our own cgroup must already let
children use the controllers (a delegated subtree) or accept `+pids +memory`. Where
neither works the limits are a gap the sandbox reports, never silently assumed.
"""

import asyncio
import contextlib
import itertools
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

KILL_ROUNDS = 200  # rounds of kill-everything-listed; a forking tree empties in a few
LAUNCHER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_cell_numbers = itertools.count()


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class CommandLimits:
    """None: no limit of that kind. The defaults leave room for parallel builds and big
    test runs, and keep a runaway command from taking the harness's machine down."""

    max_processes: int | None = 2048  # threads count too (the pids controller's unit)
    max_memory_bytes: int | None = field(default_factory=lambda: physical_memory_bytes() // 2)

    def __post_init__(self):
        for name in ("max_processes", "max_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive (or None for no limit)")


@dataclass(frozen=True)
class CgroupController:
    name: str  # "pids" or "memory"
    parent: Path  # our own cgroup in the hierarchy that has this controller
    limit_file: str


class CgroupLimits:
    """The cgroups this process may create, found once; `cell()` makes one for a call."""

    def __init__(self, limits: CommandLimits):
        self.limits = limits
        self.controllers: list[CgroupController] = []
        self.missing: list[str] = []  # why a limit asked for cannot be had here
        wanted = [
            name
            for name, value in (
                ("pids", limits.max_processes),
                ("memory", limits.max_memory_bytes),
            )
            if value is not None
        ]
        for name in wanted:
            controller = _find_controller(name)
            if isinstance(controller, str):
                kind = "process" if name == "pids" else "memory"
                self.missing.append(f"no {kind} limit: {controller}")
            else:
                self.controllers.append(controller)

    def cell(self) -> "LimitCell":
        """A fresh cgroup with the limits written; OSError if the kernel refuses one."""
        name = f"once-shell-{os.getpid()}-{next(_cell_numbers)}"
        cell = LimitCell([])
        try:
            for controller in self.controllers:
                path = controller.parent / name
                if path not in cell.paths:
                    path.mkdir()
                    cell.paths.append(path)
                value = (
                    self.limits.max_processes
                    if controller.name == "pids"
                    else self.limits.max_memory_bytes
                )
                (path / controller.limit_file).write_text(str(value))
        except OSError:
            for path in reversed(cell.paths):  # nothing ran in it yet: empty
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return cell


@dataclass
class LimitCell:
    """One call's cgroup (one directory per v1 hierarchy, or one v2 directory)."""

    paths: list[Path]

    def launcher(self, argv: list[str]) -> list[str]:
        """`argv`, entering this cgroup first (exit code 125 if it cannot)."""
        procs = [str(path / "cgroup.procs") for path in self.paths]
        return ["/bin/sh", "-c", LAUNCHER, "once-limits", *procs, "--", *argv]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return sorted(found)

    async def kill_all(self) -> None:
        # v2 kills the whole cgroup atomically; v1 lists and kills until none is left (a
        # process may fork between the listing and its kill, so the listing repeats).
        for path in self.paths:
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
        for _ in range(KILL_ROUNDS):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.005)

    async def remove(self) -> None:
        """Kill what is left and remove the cgroup (rmdir waits for the last exits)."""
        await self.kill_all()
        for path in reversed(self.paths):
            for _ in range(KILL_ROUNDS):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a killed process has not finished exiting
                    await asyncio.sleep(0.005)
        self.paths = []


def _find_controller(name: str) -> CgroupController | str:
    """Our own cgroup in the hierarchy with `name`, if we may make children there; else why
    not (a reason the sandbox reports)."""
    mounts = _cgroup_mounts()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, relative = line.split(":", 2)
        if name in controllers.split(","):
            mount = mounts.get(name)
            if mount is None:
                return f"the cgroup v1 {name} hierarchy is not mounted"
            parent = mount[0] / os.path.relpath(relative, mount[1])
            limit_file = "pids.max" if name == "pids" else "memory.limit_in_bytes"
            return _writable(name, parent.resolve(), limit_file)
    unified = mounts.get("")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::") and unified is not None:
            parent = (unified[0] / os.path.relpath(line[3:], unified[1])).resolve()
            if not _v2_delegates(parent, name):
                return f"cgroup v2 at {parent} does not let children use {name}"
            return _writable(name, parent, "pids.max" if name == "pids" else "memory.max")
    return f"no cgroup hierarchy has the {name} controller"


def _writable(name: str, parent: Path, limit_file: str) -> CgroupController | str:
    probe = parent / f"once-probe-{os.getpid()}-{next(_cell_numbers)}"
    try:
        probe.mkdir()
        try:
            if not (probe / limit_file).exists():
                return f"{probe} has no {limit_file}"
        finally:
            probe.rmdir()
    except OSError as e:
        return f"cannot create a {name} cgroup under {parent}: {e.strerror}"
    return CgroupController(name, parent, limit_file)


def _v2_delegates(parent: Path, name: str) -> bool:
    control = parent / "cgroup.subtree_control"
    try:
        if name in control.read_text().split():
            return True
        control.write_text(f"+{name}")  # refused while our cgroup holds processes
        return name in control.read_text().split()
    except OSError:
        return False


def _cgroup_mounts() -> dict[str, tuple[Path, str]]:
    """controller -> (mount point, the cgroup path the mount shows as its root); "" is v2."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3]
        mount_root, mount_point = fields[3], Path(fields[4])
        if fstype == "cgroup2":
            mounts.setdefault("", (mount_point, mount_root))
        elif fstype == "cgroup":
            for option in options.split(","):
                mounts.setdefault(option, (mount_point, mount_root))
    return mounts
