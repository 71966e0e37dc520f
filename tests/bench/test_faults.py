"""Each fault of issue 19 injected once, as `once bench reliability` runs it
(src/once/bench/reliability/faults.py): every check of the scenario holds, and no session
and no stored response is lost. The scenarios start real processes (engine replicas, a
gateway, redis-server) on loopback and kill them; each is bounded by its own timeouts."""

import shutil

import pytest

from once.bench.reliability.fault_kit import FaultContext
from once.bench.reliability.faults import SCENARIOS, run_scenario
from once.gateway.testing import load_runtime


@pytest.fixture(scope="module")
def runtime():
    return load_runtime()


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_fault_is_survived(name, runtime, tmp_path):
    if name == "redis_restarted" and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    result = await run_scenario(name, FaultContext(tmp_path, runtime))
    print(result.to_dict())  # the scenario's figure, with -s
    assert result.detail.get("error") is None, result.detail["error"]
    assert result.failed_checks() == [], result.to_dict()
    assert (result.sessions_lost, result.stored_responses_lost) == (0, 0), result.to_dict()
    assert result.passed
