"""The CPUs once may really use, and OpenMP threads that give a core back when they wait.

Two facts about sharing a machine (issue 31), measured with `once bench engine
--contention` (README, "Sharing the cores"):

- The cores a process may use are its affinity mask capped by its cgroup's CPU quota (a
  container given 2 CPUs of a 64-core host still sees 64 in `os.cpu_count()`, and
  OpenMP's default team follows the mask only). `usable_cores` reads both.
- OpenMP threads that wait at a barrier spin by default (libgomp: ~300k iterations, far
  past a microsecond) before they sleep. On an oversubscribed core the spinning thread
  holds the core its straggling sibling needs, so every parallel region (hundreds per
  decode step) waits out a scheduler slice: on two cores with a busy process beside it
  the engine's c8 decode fell to a tenth of its quiet rate, not to the fair two thirds.
  `once.yield_waiting_threads` makes waiting threads sleep at once
  (`OMP_WAIT_POLICY=PASSIVE` for libgomp, which torch's CPU wheels use; `KMP_BLOCKTIME=0`
  for Intel's OpenMP). The runtime reads these when it loads, so `once/__init__.py` sets
  them, before any module imports torch; whoever set any of OPENMP_WAIT_VARS chose
  already, and keeps the choice.
"""

import math
import os
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")  # v1: quota -1 when unlimited


def usable_cores(cgroup_root: Path | None = None) -> int:
    """Cores this process may run on at once: affinity, capped by a CPU quota (>= 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cpu_quota(cgroup_root: Path | None = None) -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None without a limit."""
    v2 = (cgroup_root / "cpu.max") if cgroup_root is not None else _CGROUP_V2
    v1 = cgroup_root if cgroup_root is not None else _CGROUP_V1
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
