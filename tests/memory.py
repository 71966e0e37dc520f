"""What one pytest process does to stay small over the whole suite, and a log to check it.

`make test` runs ~1,700 tests in one process, and many of them build engines (SmolLM2:
0.5 GB of weights, as much again packed for oneDNN, and a KV pool) behind a gateway or
an engine server. Before this module, every one of them stayed resident: the process
grew ~600 MB per replay stack and was OOM-killed at 12-14 GB, a quarter to half of the
way in (issue 30). What held them, and what releases them:

- FastAPI keeps every endpoint function it has classified in module-level LRU caches
  (`fastapi.dependencies.models`, 4,096 entries each). The gateway's and the engine
  server's endpoints are closures over their engine, so each app ever built kept its
  engine alive. `forget_endpoints` empties those caches after each test; a server
  process builds one app, so only a process that builds hundreds (this one) needs it.
- An engine is in reference cycles (its own bound methods, handed to its KV manager), so
  dropping it frees nothing until a full collection; and the last test of a module
  holds the module's fixtures until its `funcargs` go, after the teardown hooks.
  `Releaser` collects once that is done, at each module's end.
- glibc keeps freed heap in its arenas (`keep_freed_memory`, which every CPU engine
  sets, raises the trim threshold to 512 MiB per arena): `return_freed_memory` trims it.

ONCE_TEST_RSS_LOG=path turns on `RssLog`: each test (setup, call and teardown) appends
one tab-separated line `nodeid rss_kb delta_kb peak_kb anon_kb threads children_max_kb`,
read from /proc/self/status after the test's teardown, so a fixture that outlives its
test shows up where it is released, not where it was made. `sort -t$'\\t' -k3 -n` finds
the growers, `-k4` the tests that peak. The peak (VmHWM) is reset after each test, so
with the log on, `/usr/bin/time -v` under-reports the run's maximum: the log's last line
has it.
"""

import ctypes
import gc
import resource
import sys
from pathlib import Path

import pytest

LOG_ENV = "ONCE_TEST_RSS_LOG"
RELEASE_GROWTH_KB = 256 * 1024


def forget_endpoints() -> None:
    """Empty FastAPI's caches of endpoint functions, so apps no test holds can be freed."""
    models = sys.modules.get("fastapi.dependencies.models")
    if models is None:
        return
    for value in vars(models).values():
        cache_clear = getattr(value, "cache_clear", None)
        if callable(cache_clear):
            cache_clear()


def return_freed_memory() -> None:
    """Collect cycles, then have glibc return its free heap pages to the OS."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def process_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon (kB) and Threads of this process; empty without /proc."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


def reset_peak_rss() -> None:
    """Start VmHWM over from the current RSS (Linux: "5" to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class Releaser:
    """After each test, FastAPI forgets its endpoints. When a module ends, or the process
    grew by RELEASE_GROWTH_KB since the last release, cycles are collected and malloc is
    trimmed: a full collection of the suite's ~560k objects takes ~0.25 s, too long to
    run after each of ~1,700 tests. It runs once the test's `funcargs` are dropped: until
    then the last test of a module still holds the module's fixtures (an engine, its KV)."""

    def __init__(self):
        self.released_kb = 0

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        forget_endpoints()
        rss_kb = process_status().get("VmRSS", 0)
        module_ends = nextitem is None or nextitem.path != item.path
        if module_ends or rss_kb - self.released_kb > RELEASE_GROWTH_KB:
            return_freed_memory()
            self.released_kb = process_status().get("VmRSS", 0)


class RssLog:
    """One line per test: nodeid, RSS after it, the change, the peak during it, RssAnon,
    threads, and the largest RSS of any child process reaped so far (`time -v` reports
    the largest of the whole tree)."""

    def __init__(self, path: str):
        self.path = path
        self.previous_kb = process_status().get("VmRSS", 0)

    def write(self, label: str) -> None:
        status = process_status()
        rss_kb = status.get("VmRSS", 0)
        children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        fields = (
            label,
            rss_kb,
            rss_kb - self.previous_kb,
            status.get("VmHWM", 0),
            status.get("RssAnon", 0),
            status.get("Threads", 0),
            children_kb,
        )
        self.previous_kb = rss_kb
        with open(self.path, "a") as log:
            log.write("\t".join(map(str, fields)) + "\n")
        reset_peak_rss()

    def pytest_collection_finish(self, session) -> None:
        self.write("<collection>")

    def pytest_sessionfinish(self, session) -> None:
        # Each test's peak was reset after it, so `time -v` and getrusage now report only
        # the last test's: the run's own peak is the largest in this log.
        with open(self.path) as log:
            peak_kb = max(int(line.split("\t")[3]) for line in log)
        with open(self.path, "a") as log:
            log.write(f"<run peak>\t{peak_kb}\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        self.write(item.nodeid)
