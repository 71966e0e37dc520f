"""The engine's threads, named where the kernel can see them.

The step loop names its OS thread (Linux `comm`, through prctl) before it runs anything,
and a thread takes its name from the thread that creates it, so the OpenMP workers the
loop's first parallel region starts (libgomp keeps a pool per calling thread) carry the
same name. Whoever measures the engine's CPU reads `/proc/self/task/<tid>/comm`: what a
thread is, not whether Python still lists it (a joined thread can linger in /proc after
`threading` forgets it).
"""

import ctypes
import ctypes.util
import sys
from pathlib import Path

ENGINE_THREAD_NAME = "once-engine"  # at most 15 bytes: the kernel's limit
_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Name the calling thread for the kernel (Linux only; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no libc to call: threads stay unnamed and count where they ran


def os_thread_name(task: Path) -> str | None:
    """The kernel's name of a thread, from its /proc/<pid>/task/<tid> folder."""
    try:
        return (task / "comm").read_text().strip()
    except OSError:
        return None  # it exited meanwhile
