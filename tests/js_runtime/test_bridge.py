"""The bridge between V8 and Python holds whatever the program does to its isolate.

The prelude builds messages only from what it captured before the program ran, so a
program that rewrites builtins still ends as a program (the escape attempts in
once.bench.reliability.js_escapes run those). Python checks every message anyway: these
tests give the check outboxes no prelude would send, and the output cap a flood.
"""

import pytest

from once.js_runtime.limits import RunLimits
from once.js_runtime.runner import Answer, ProgramRun, _BrokenBridge, _parse_outbox


async def echo(call):
    return Answer("ok")


@pytest.mark.parametrize(
    "drained",
    [
        "42",  # Array.prototype.toJSON returning a number
        '"text"',
        "not json",
        "[1]",
        "[[]]",
        '[["print"]]',
        '[["print", ["a"]]]',
        '[[["print"], "x"]]',  # an unhashable kind
        '[["call", "1", "f", "{}"]]',
        '[["call", true, "f", "{}"]]',  # a bool is not a call id
        '[["call", 1.5, "f", "{}"]]',
        '[["call", 1, "f", {}]]',
        '[["timer", 1, null]]',  # what JSON.stringify makes of Infinity
        '[["timer", 1, Infinity]]',  # Python's json accepts it; the check does not
        '[["done", 1, "x"]]',
        '[["done", true, ["x"]]]',
        '[["exec", "rm -rf /"]]',
    ],
)
def test_messages_of_unknown_shape_break_the_bridge(drained):
    with pytest.raises(_BrokenBridge):
        _parse_outbox(drained)


def test_the_messages_the_prelude_sends_pass():
    drained = (
        '[["print", "a b"], ["call", 0, "f", "{\\"x\\":1}"], ["timer", 1, 2.5], '
        '["done", true, null], ["done", false, "Uncaught Error: x"]]'
    )
    assert [m[0] for m in _parse_outbox(drained)] == ["print", "call", "timer", "done", "done"]


@pytest.mark.parametrize(
    "program, output",
    [
        ("String = () => [1, 2]; return () => 1", "() => 1"),
        ("Array.prototype.toJSON = () => 42; print('x'); await tools.f({}); return 1", "x\n1"),
        ("setTimeout(() => 1, Infinity); return 'a'", "a"),
        (
            "Object.defineProperty(Array.prototype, '0', {set(v) {}}); print('hi'); return 2",
            "hi\n2",
        ),
        ("Error = 5; throw {toString() { throw 1 }}", "Uncaught {}"),
    ],
)
async def test_a_program_that_rewrites_builtins_still_talks_to_the_host(program, output):
    run = ProgramRun(["f"], RunLimits(timeout_s=10), call_tool=echo)
    await run.run(program)
    assert run.output_text() == output
    assert run.stopped is None


async def test_a_refusal_reaches_a_program_that_broke_map():
    run = ProgramRun(["f"], RunLimits(timeout_s=10), call_tool=echo, refuse=lambda call: "no")
    await run.run("Map.prototype.get = () => { throw new Error('mine') }; await tools.f({})")
    assert run.output_text() == "Uncaught Error: no"


async def test_output_past_the_limit_stops_the_program():
    limit = 4 << 20
    program = (
        "for (let i = 0; i < 32; i++) {"
        " print('x'.repeat(1 << 20)); await new Promise((r) => setTimeout(r, 0)); }"
        " return 'never'"
    )
    run = ProgramRun([], RunLimits(timeout_s=20, max_output_bytes=limit), call_tool=echo)
    await run.run(program)
    assert run.stopped == "output" and run.result is None
    assert run.error == "program stopped: it exceeded the 4 MiB output limit"
    assert sum(len(text) for text in run.printed) <= limit
    with pytest.raises(ValueError):
        RunLimits(max_output_bytes=0)
