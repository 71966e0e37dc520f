"""Replay runs: a deterministic program whose calls are answered in rounds.

A replay must repeat itself: the same answers give the same calls in the same rounds, the
same random numbers and dates; a round with an unanswered call suspends the run; timers
run on a virtual clock; limits hold as in a live run (tests/agent/test_code_mode.py).
"""

import time

import pytest

from once.js_runtime.limits import Determinism, RunLimits
from once.js_runtime.runner import Answer, ProgramCall, ProgramRun, Replay

SEED = Determinism(epoch_ms=1_700_000_000_000, seed=42)
PROGRAM = """
const r = Math.random();
const [a, b] = await Promise.all([tools.f({x: 1}), tools.g({y: r})]);
const c = await tools.f({x: a + b});
return [a, b, c, Date.now()];
"""


class Recording:
    """Answers in call order from a list; past its end, nothing (the run suspends)."""

    def __init__(self, answers: list[str]):
        self.answers = answers
        self.calls: list[tuple[str, str]] = []

    def __call__(self, call: ProgramCall) -> Answer | None:
        self.calls.append((call.name, call.arguments))
        k = len(self.calls) - 1
        return Answer(self.answers[k]) if k < len(self.answers) else None


async def replay(code: str, answers: list[str], determinism=SEED, **limits) -> tuple:
    recording = Recording(answers)
    run = ProgramRun(["f", "g"], RunLimits(**limits), replay=Replay(determinism, recording))
    await run.run(code)
    return run, recording


async def test_calls_come_in_rounds_and_a_missing_answer_suspends_the_run():
    run, recording = await replay(PROGRAM, [])
    assert not run.finished and run.output_text() == ""
    assert [(c.name, a) for c, a in run.suspended] == [("f", None), ("g", None)]  # one round
    first_round = recording.calls

    run, recording = await replay(PROGRAM, ["A", "B"])
    assert recording.calls[:2] == first_round  # Math.random repeated: the same arguments
    assert [(c.name, c.arguments) for c, _ in run.suspended] == [("f", '{"x":"AB"}')]

    run, _ = await replay(PROGRAM, ["A", "B", "C"])
    assert run.finished and run.error is None
    assert run.output_text() == f'["A","B","C",{SEED.epoch_ms}]'


async def test_a_rejected_answer_throws_in_the_program():
    code = "try { await tools.f({}) } catch (e) { return 'caught ' + e.message }"
    run = ProgramRun(
        ["f"], RunLimits(), replay=Replay(SEED, lambda call: Answer("no such city", True))
    )
    await run.run(code)
    assert run.output_text() == "caught no such city"


async def test_timers_run_on_a_virtual_clock_in_order():
    code = """
    const order = [];
    setTimeout(() => order.push('late'), 50000);
    setTimeout(() => order.push('early'), 10);
    setTimeout(() => order.push('tie'), 10);
    await new Promise((resolve) => setTimeout(resolve, 60000));
    return [order, Date.now() - SEED_EPOCH, new Date().getTime() === Date.now()];
    """.replace("SEED_EPOCH", str(SEED.epoch_ms))
    started = time.perf_counter()
    run, _ = await replay(code, [])
    assert run.output_text() == '[["early","tie","late"],60000,true]'
    assert time.perf_counter() - started < 2  # a minute of timers took no time


async def test_the_seed_and_epoch_are_what_the_program_sees():
    code = "return [Math.random(), Math.random(), new Date().toISOString(), typeof WeakRef]"
    one, _ = await replay(code, [], Determinism(0, 1))
    two, _ = await replay(code, [], Determinism(0, 1))
    other, _ = await replay(code, [], Determinism(86_400_000, 2))
    assert one.output_text() == two.output_text() != other.output_text()
    assert '"1970-01-01T00:00:00.000Z","undefined"]' in one.output_text()
    assert '"1970-01-02T00:00:00.000Z"' in other.output_text()


@pytest.mark.parametrize(
    ("code", "stopped"),
    [
        ("while (true) {}", "timeout"),
        ("await null; let a = []; while (true) a.push(new Array(1e6).fill(1));", "memory"),
        ("await new Promise(() => {});", "stuck"),  # nothing could ever settle it
    ],
)
async def test_limits_stop_a_replay(code, stopped):
    # Only the timeout case gets a short limit. The others get a long one (a hang guard):
    # on a loaded machine 0.5 s may end before 32 MiB are filled or before the program
    # is seen stuck, and the heap limit or the stuck check is what those cases are about.
    timeout_s = 0.5 if stopped == "timeout" else 20.0
    run, _ = await replay(code, [], timeout_s=timeout_s, max_heap_bytes=32 << 20)
    assert run.stopped == stopped and run.error.startswith("program stopped")
    assert not run.suspended


async def test_calls_past_the_limit_are_refused_in_the_round():
    code = (
        "const rs = await Promise.allSettled([1, 2, 3].map(() => tools.f({})));\n"
        "return rs.map((r) => r.status)"
    )
    run, recording = await replay(code, ["a", "b"], max_tool_calls=2)
    assert len(recording.calls) == 2  # the third was refused without asking
    assert run.output_text() == '["fulfilled","fulfilled","rejected"]'


def test_a_run_is_live_or_a_replay():
    with pytest.raises(ValueError):
        ProgramRun([], RunLimits())
