"""The safety gate's states: holding or streaming while the check runs, then passed (held
output released) or failed (held output dropped unseen)."""

import asyncio

import pytest

from once.gateway.safety.checker import SafetyVerdict
from once.gateway.safety.gate import SafetyGate

CLEAN = SafetyVerdict(False, None, 0.1, "embedding", 0.01)
FLAGGED = SafetyVerdict(True, "violence", 0.9, "embedding", 0.01)


def _run(verdict, hold):
    async def body():
        seen = []
        check = asyncio.get_running_loop().create_future()
        gate = SafetyGate(check, hold=hold, on_verdict=seen.append)  # type: ignore[arg-type]
        shown = gate.admit(["a", "b"])  # type: ignore[list-item]
        assert not gate.verdict_ready()
        check.set_result(verdict)
        assert gate.verdict_ready()
        released = await gate.settle()
        after = gate.admit(["c"])  # type: ignore[list-item]
        return gate, seen, shown, released, after

    return asyncio.run(body())


@pytest.mark.parametrize("hold", [True, False])
def test_a_clean_verdict_releases_what_was_held_and_opens_the_gate(hold):
    gate, seen, shown, released, after = _run(CLEAN, hold)
    assert seen == [CLEAN] and not gate.failed and gate.check is None
    assert (shown, released) == (([], ["a", "b"]) if hold else (["a", "b"], []))
    assert after == ["c"]


@pytest.mark.parametrize("hold", [True, False])
def test_a_flagged_input_fails_and_drops_only_output_nobody_saw(hold):
    gate, _, shown, released, _ = _run(FLAGGED, hold)
    assert gate.failed and released == []
    assert gate.output_dropped is hold  # under stream the client already saw "a", "b"
    assert shown == ([] if hold else ["a", "b"])


def test_no_check_means_passed_from_the_start():
    gate = SafetyGate(None, hold=True, on_verdict=lambda verdict: None)
    assert gate.admit(["a"]) == ["a"]  # type: ignore[list-item]
    assert asyncio.run(gate.settle()) == [] and not gate.failed
