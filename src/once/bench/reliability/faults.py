"""Faults injected into the stack, each a scenario with its figure (issue 19, item 4).

Every scenario runs on loopback, bounded in count and time, and returns a `FaultResult`:
whether every check held, how many sessions and stored responses the fault lost (the bar
is 0 and 0 over all of them), the figures it measured, and its wall time. The tests
(tests/bench/test_faults.py) run the same functions, from `SCENARIOS`.

    replica_killed       fault_replica.py   a `once engine` replica SIGKILLed mid-stream
    gateway_restarted    fault_restart.py   the gateway SIGKILLed between turns, restarted
    redis_restarted      fault_redis.py     Redis killed and restarted under the store and
                                            the rate limits
    store_disk_full      fault_store.py     the SQLite store out of room
    slow_clients         fault_slow.py      a reader that stops reading, slowloris clients
    kv_burst             fault_kv_burst.py  a burst past the engine's KV blocks and queue

`run_faults()` runs them all, in that order, and returns the totals with each result.
"""

import asyncio
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from once.bench.reliability.fault_kit import FaultContext, FaultResult
from once.bench.reliability.fault_kv_burst import kv_blocks_exhausted_by_a_burst
from once.bench.reliability.fault_redis import redis_stopped_and_restarted
from once.bench.reliability.fault_replica import replica_killed_mid_stream
from once.bench.reliability.fault_restart import gateway_restarted_mid_session
from once.bench.reliability.fault_slow import slow_reader_and_slowloris
from once.bench.reliability.fault_store import store_disk_full

SCENARIO_TIMEOUT_S = 120.0  # a hang guard: each scenario takes seconds

Scenario = Callable[[FaultContext], Awaitable[FaultResult]]
SCENARIOS: dict[str, Scenario] = {
    "replica_killed": replica_killed_mid_stream,
    "gateway_restarted": gateway_restarted_mid_session,
    "redis_restarted": redis_stopped_and_restarted,
    "store_disk_full": store_disk_full,
    "slow_clients": slow_reader_and_slowloris,
    "kv_burst": kv_blocks_exhausted_by_a_burst,
}


async def run_scenario(name: str, context: FaultContext) -> FaultResult:
    """One scenario, timed; one that raises or hangs is a failed result, not an error."""
    scenario = SCENARIOS[name]
    started = time.perf_counter()
    try:
        async with asyncio.timeout(SCENARIO_TIMEOUT_S):
            result = await scenario(context)
    except Exception as exc:  # noqa: BLE001 - reported as the scenario's failure
        result = FaultResult(name, {"ran to the end": False})
        result.detail["error"] = "".join(traceback.format_exception_only(exc)).strip()
    result.seconds = round(time.perf_counter() - started, 2)
    return result


async def run_all(names: Sequence[str] = tuple(SCENARIOS)) -> list[FaultResult]:
    with tempfile.TemporaryDirectory(prefix="once-faults-") as tmp:
        context = FaultContext(Path(tmp))
        return [await run_scenario(name, context) for name in names]


def run_faults() -> dict:
    """Every scenario once: the totals, and each scenario's result."""
    results = asyncio.run(run_all())
    return {
        "faults": [result.to_dict() for result in results],
        "num_faults": len(results),
        "num_passed": sum(result.passed for result in results),
        "sessions_lost": sum(result.sessions_lost for result in results),
        "stored_responses_lost": sum(result.stored_responses_lost for result in results),
    }
