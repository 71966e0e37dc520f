"""`once bench reliability`'s abandoned-request part: every door, the engine stops."""

import asyncio

import pytest

from once.bench.reliability.abandoned import CASES, run_case
from once.gateway.testing import load_runtime


@pytest.fixture(scope="module")
def runtime():
    return load_runtime()


@pytest.mark.parametrize("name", ["responses_json", "messages_sse", "responses_ws"])
def test_an_abandoned_request_produces_nothing_a_second_after_the_client_left(runtime, name):
    assert name in CASES
    case = asyncio.run(run_case(runtime, name))
    assert case["finish"] == "abort"
    assert case["late"] == 0
    assert 0 < case["tokens"] < 1000  # of the 2,000 the script holds
