"""The real clients, one tool round trip each against the real gateway (registry.py).

Codex CLI and Claude Code are the npm binaries `make clients` installs; the Python clients
are the packages of the test extra. Each test fails with what the client printed or
raised, verbatim, and with what the gateway counted.
"""

import pytest

from once.bench.clients.registry import CASES, run_case

pytestmark = pytest.mark.clients


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_the_client_completes_a_tool_round_trip(runtime, case):
    result = await run_case(case, runtime)
    assert result.connected, result
    assert result.gateway_errors == 0, result
    assert result.tool_round_trip, result
    assert result.finished, result.first_error
    assert result.streamed, result
