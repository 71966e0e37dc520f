"""Sandbox escape attempts for `once bench reliability`: every attempt, one summary.

The attempts (shell_escapes.py, patch_escapes.py, js_escapes.py) are the same functions
tests/bench/test_reliability_sandbox.py asserts on; each runs in a fresh arena
(sandbox_arena.py) and returns whether it was blocked, judged on the host. The bar is
`sandbox_escapes == 0`. An attempt this host cannot hold back (no bubblewrap, no cgroup
to limit processes) counts as an escape, with the reason in its detail; an attempt that
raises counts as one too.
"""

import asyncio
import time
from collections.abc import Iterable

from once.bench.reliability.js_escapes import JS_ATTEMPTS
from once.bench.reliability.patch_escapes import PATCH_ATTEMPTS
from once.bench.reliability.sandbox_arena import Attempt, Outcome, arena
from once.bench.reliability.shell_escapes import SHELL_ATTEMPTS

ATTEMPTS: list[Attempt] = [*SHELL_ATTEMPTS, *PATCH_ATTEMPTS, *JS_ATTEMPTS]


async def run_attempt(attempt: Attempt) -> Outcome:
    async with arena() as place:
        try:
            return await attempt.run(place)
        except Exception as e:  # an attempt that crashes the harness's side is not blocked
            return Outcome(attempt.name, False, f"raised {type(e).__name__}: {e}")


async def run_attempts_async(names: Iterable[str] | None = None) -> dict:
    wanted = set(names) if names is not None else None
    unknown = (wanted or set()) - {a.name for a in ATTEMPTS}
    if unknown:
        raise ValueError(f"unknown sandbox attempts: {sorted(unknown)}")
    start = time.perf_counter()
    outcomes = [await run_attempt(a) for a in ATTEMPTS if wanted is None or a.name in wanted]
    return {
        "sandbox_attempts": len(outcomes),
        "sandbox_escapes": sum(not o.blocked for o in outcomes),
        "sandbox_unsupported": sum(o.unsupported is not None for o in outcomes),
        "sandbox_wall_s": round(time.perf_counter() - start, 2),
        "attempts": [{"name": o.name, "blocked": o.blocked, "detail": o.detail} for o in outcomes],
    }


def run_attempts(names: Iterable[str] | None = None) -> dict:
    """Run the attempts (all, or those named) on a fresh event loop; from sync code only."""
    return asyncio.run(run_attempts_async(names))


if __name__ == "__main__":
    import json

    print(json.dumps(run_attempts(), indent=2))
