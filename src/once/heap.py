"""A server's heap: its startup heap frozen, so garbage collection stops walking it, and
malloc told to keep freed memory (`keep_freed_memory`).

CPython's cyclic collector walks every tracked object of the generation it collects, and
a full (generation 2) collection walks them all. A gateway process holds ~380k objects
once its tokenizer, chat template and the SDK's types are loaded; a full collection of
that heap took ~190 ms here, and it stalls every stream the event loop is serving. The
startup heap lives as long as the process, so it is moved to the permanent generation
(`gc.freeze`) just before the server starts serving: later collections walk only what
was allocated since. Objects frozen this way are still freed by reference counting; only
cycles among them are kept, which for load-time objects is what we want anyway.
"""

import ctypes
import gc
import sys

# mallopt parameters (malloc.h) and the values servers set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest; only weights and KV pools are bigger
_TRIM_THRESHOLD = 512 << 20  # freed top-of-heap memory kept for the next use
_TOP_PAD = 64 << 20  # grow the heap in large steps, so fewer calls fault pages in


def freeze_startup_heap() -> int:
    """Collect what startup left behind, then freeze the rest; returns objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def keep_freed_memory() -> bool:
    """Have glibc's malloc reuse freed memory rather than map and unmap it each time.

    Above its mmap threshold glibc serves every allocation with a fresh mapping, and it
    trims freed heap back to the OS, so each large buffer is page-faulted in (and zeroed
    by the kernel) again: the engine's activations every step, and the gateway's copies of
    a large body (its bytes, its text, the decoded JSON string), which made those faults
    about half of what refusing a 20 MB prompt cost.

    Process-wide and idempotent; False where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    if not hasattr(libc, "mallopt"):
        return False
    settings = (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        (_M_TOP_PAD, _TOP_PAD),
    )
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
