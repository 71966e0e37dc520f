"""Programmatic tool calling: the gateway runs the model's program, the client its functions.

The scripted model writes a program that calls two client functions with Promise.all; the
response ends with their `function_call` items (caller: the program); the request that
brings their outputs resumes the program by replay, which ends in a `program_output`
and the model's final text, in that same response. Over HTTP with `store: false` (every
item resent), with `store: true` (the chain), and over WebSocket (the connection's
state), the engine must see the same prompts. Every response and event is parsed with
the SDK's types.
"""

import json
import time

import openai
import pytest
from openai.types.responses import Response

from once.gateway.hosted.base import HostedTools
from once.gateway.hosted.program_tool import (
    PROGRAM_TOOL_NAME,
    FingerprintMismatch,
    new_fingerprint,
    replay_determinism,
)
from once.gateway.hosted.programs import ProgrammaticToolCalling
from once.gateway.prompt.render import sorted_tools
from once.js_runtime.limits import RunLimits
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway
from tests.gateway.test_http import as_input, client_for, metric, user, validate_events
from tests.gateway.test_websocket import completed

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city. Client-side.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "allowed_callers": ["programmatic"],
}
GEO = {
    "type": "namespace",
    "name": "geo",
    "description": "Geography.",
    "tools": [
        {
            "type": "function",
            "name": "distance",
            "description": "Distance in km.",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            "allowed_callers": ["direct", "programmatic"],
        }
    ],
}
TOOLS = [{"type": "programmatic_tool_calling"}, WEATHER, GEO]
PROGRAM = (
    "const [oslo, rome] = await Promise.all(["
    'tools.get_weather({city: "Oslo"}), tools.get_weather({city: "Rome"})]);\n'
    'text("Oslo: " + oslo);\n'
    'text("Rome: " + rome);\n'
    'return "done";'
)
FINAL = "Sunny in Oslo, rain in Rome."
QUESTION = user("Weather in Oslo and Rome?")


def block(name: str, **payload) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, **payload}) + "\n</tool_call>"


def outputs_for(response, answers: dict[str, str]) -> list[dict]:
    """The client runs the program's calls: one output per call, by the call's city."""
    return [
        {"type": "function_call_output", "call_id": item.call_id,
         "output": answers[json.loads(item.arguments)["city"]]}
        for item in response.output
        if item.type == "function_call"
    ]  # fmt: skip


async def streamed(client, **request) -> tuple[object, list]:
    events = []
    stream = await client.responses.create(stream=True, **request)
    async for event in stream:
        events.append(event)
    validate_events(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("response.created") == 1
    return events[-1].response, events


def check_suspended(first) -> None:
    Response.model_validate(first.to_dict())
    program, *calls = first.output
    assert program.type == "program" and program.code == PROGRAM
    assert program.fingerprint.startswith("ptc1.")
    assert [(c.type, c.name, json.loads(c.arguments)) for c in calls] == [
        ("function_call", "get_weather", {"city": "Oslo"}),
        ("function_call", "get_weather", {"city": "Rome"}),
    ]
    assert {c.caller.type for c in calls} == {"program"}
    assert {c.caller.caller_id for c in calls} == {program.call_id}
    assert [c.call_id for c in calls] == [f"{program.call_id}#0", f"{program.call_id}#1"]
    assert first.status == "completed"


def check_resumed(second, program_call_id: str) -> None:
    Response.model_validate(second.to_dict())
    output, message = second.output
    assert (output.type, output.call_id, output.status) == (
        "program_output",
        program_call_id,
        "completed",
    )
    assert output.result == "Oslo: sunny\nRome: rain\ndone"
    assert message.type == "message" and second.output_text == FINAL


def check_prompts(runtime, engine) -> list[list[int]]:
    """The engine saw two prompts: the question, then the program's output at the tail."""
    assert len(engine.requests) == 2  # the resume ran no model step before the output
    first, second = (list(r.prompt_token_ids) for r in engine.requests)
    context = len(first) - 3  # the generation prompt: "<|im_start|>", "assistant", "\n"
    assert second[:context] == first[:context]
    tail = runtime.tokenizer.decode(second[context:])
    assert tail.count("<tool_call>") == 1 and '"name": "program"' in tail  # the program only
    assert tail.count("<tool_response>") == 1 and "Oslo: sunny\nRome: rain\ndone" in tail
    head = runtime.tokenizer.decode(first)
    # Only a program may call get_weather: listed in its description, not as a tool.
    assert '"name":"get_weather"' not in head and "tools.get_weather({city?: string})" in head
    assert '"name":"geo"' in head and "tools.geo__distance({a?: string})" in head
    return [first, second]


async def test_a_program_suspends_on_client_calls_and_resumes_with_their_outputs(runtime):
    engine = scripted_texts(runtime, [block(PROGRAM_TOOL_NAME, input=PROGRAM), FINAL])
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        first, events = await streamed(
            client, model=MODEL, input=[QUESTION], tools=TOOLS, store=False
        )
        check_suspended(first)
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        done = [e.item.type for e in events if e.type == "response.output_item.done"]
        assert added == done == ["program", "function_call", "function_call"]
        resent = [
            QUESTION,
            *as_input(first),
            *outputs_for(first, {"Oslo": "sunny", "Rome": "rain"}),
        ]
        second, events = await streamed(client, model=MODEL, input=resent, tools=TOOLS, store=False)
        check_resumed(second, first.output[0].call_id)
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == [
            "program_output",
            "message",
        ]
        stateless = check_prompts(runtime, engine)

    engine = scripted_texts(runtime, [block(PROGRAM_TOOL_NAME, input=PROGRAM), FINAL])
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        first = await client.responses.create(model=MODEL, input=[QUESTION], tools=TOOLS)
        check_suspended(first)
        answers = outputs_for(first, {"Oslo": "sunny", "Rome": "rain"})
        second = await client.responses.create(
            model=MODEL, previous_response_id=first.id, input=answers, tools=TOOLS
        )
        check_resumed(second, first.output[0].call_id)
        await gateway.drain_verifications()
        # The resume's prompt was the stored state plus its new items, checked in full.
        assert metric(gateway, "verifications") == 1 and metric(gateway, "divergences") == 0
        assert check_prompts(runtime, engine) == stateless  # the chain, from the store


async def test_a_program_resumes_over_websocket_from_the_connection_state(runtime):
    engine = scripted_texts(runtime, [block(PROGRAM_TOOL_NAME, input=PROGRAM), FINAL])
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL, input=[QUESTION], tools=TOOLS, store=False
            )
            first = await completed(connection)
            check_suspended(first)
            # Only the outputs: the program, its calls and the tools come from the connection.
            answers = outputs_for(first, {"Oslo": "sunny", "Rome": "rain"})
            await connection.response.create(previous_response_id=first.id, input=answers)
            second = await completed(connection)
        check_resumed(second, first.output[0].call_id)
        await gateway.drain_verifications()
        assert metric(gateway, "verifications") == 1 and metric(gateway, "divergences") == 0
        check_prompts(runtime, engine)


async def test_a_program_suspends_once_per_round_of_calls(runtime):
    code = (
        'const first = await tools.get_weather({city: "Oslo"});\n'
        "const second = await tools.get_weather({city: first});\n"
        "text(first, second);"
    )
    engine = scripted_texts(runtime, [block(PROGRAM_TOOL_NAME, input=code), FINAL])
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL, input=[QUESTION], tools=TOOLS, store=False
            )
            previous = await completed(connection)
            for city, answer in (("Oslo", "Bergen"), ("Bergen", "rain")):
                (call,) = [item for item in previous.output if item.type == "function_call"]
                assert json.loads(call.arguments) == {"city": city}
                output = {"type": "function_call_output", "call_id": call.call_id,
                          "output": answer}  # fmt: skip
                await connection.response.create(previous_response_id=previous.id, input=[output])
                previous = await completed(connection)
        await gateway.drain_verifications()
        assert metric(gateway, "divergences") == 0
    assert [item.type for item in previous.output] == ["program_output", "message"]
    assert previous.output[0].result == "Bergen rain"
    assert len(engine.requests) == 2  # the model ran twice: the program, the final text


async def test_a_replay_repeats_random_numbers_dates_and_timers(runtime):
    # The first run sends Math.random() and Date.now() out as arguments; the replay must
    # compute the same ones, or its call would differ from the recorded one (a 400).
    code = (
        "const r = Math.random(), t = Date.now();\n"
        "await new Promise((resolve) => setTimeout(resolve, 60000));\n"
        "const w = await tools.get_weather({city: `${r} ${t}`});\n"
        "text(w, Date.now() - t, new Date().getTime() === Date.now());"
    )
    engine = scripted_texts(runtime, [block(PROGRAM_TOOL_NAME, input=code), FINAL])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        started = time.perf_counter()
        first = await client.responses.create(model=MODEL, input=[QUESTION], tools=TOOLS)
        program, call = first.output
        city = json.loads(call.arguments)["city"]
        assert city.split()[1] == program.fingerprint.split(".")[1]  # Date: the epoch
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "fog"}
        second = await client.responses.create(
            model=MODEL, previous_response_id=first.id, input=[answer], tools=TOOLS
        )
        assert time.perf_counter() - started < 5  # a minute of timers took no time
    assert second.output[0].result == "fog 60000 true"


async def test_a_program_past_its_time_limit_or_throwing_ends_incomplete(runtime):
    # 2 s: the second program must reach its unknown tool within the limit on a busy machine.
    hosted = HostedTools([ProgrammaticToolCalling(RunLimits(timeout_s=2.0))])
    texts = [
        block(PROGRAM_TOOL_NAME, input="while (true) {}"),
        block(PROGRAM_TOOL_NAME, input="await tools.nope({});"),
        FINAL,
    ]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine, hosted=hosted) as (url, _):
        async with client_for(url) as client:
            started = time.perf_counter()
            response = await client.responses.create(model=MODEL, input=[QUESTION], tools=TOOLS)
            elapsed = time.perf_counter() - started
    Response.model_validate(response.to_dict())
    assert [item.type for item in response.output] == [
        "program", "program_output", "program", "program_output", "message",
    ]  # fmt: skip
    timed_out, unknown = response.output[1], response.output[3]
    assert timed_out.status == "incomplete"
    assert timed_out.result == "program stopped: it exceeded the 2 s time limit"
    assert unknown.status == "incomplete" and "unknown tool 'nope'" in unknown.result
    assert "tools.get_weather" in unknown.result  # it names the callable tools
    assert response.output_text == FINAL and elapsed < 15
    assert len(engine.requests) == 3  # one response: the model went on after each


async def test_a_changed_program_or_a_missing_output_is_a_400_naming_the_param(runtime):
    engine = scripted_texts(runtime, [block(PROGRAM_TOOL_NAME, input=PROGRAM), FINAL])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        first = await client.responses.create(
            model=MODEL, input=[QUESTION], tools=TOOLS, store=False
        )
        items = [QUESTION, *as_input(first)]
        answers = outputs_for(first, {"Oslo": "sunny", "Rome": "rain"})

        async def refusal(resent: list[dict]) -> openai.BadRequestError:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model=MODEL, input=resent, tools=TOOLS, store=False)
            return caught.value

        changed = [QUESTION, {**items[1], "code": PROGRAM.replace("Rome", "Paris")}, *items[2:]]
        error = await refusal([*changed, *answers])
        assert error.param == "input[1].code" and "does not match its fingerprint" in error.message

        error = await refusal([*items, answers[0]])  # Rome's output is missing
        assert error.param == "input"
        assert f"{first.output[0].call_id}#1" in error.message and "get_weather" in error.message

        other_city = {**items[3], "arguments": json.dumps({"city": "Paris"})}
        error = await refusal([*items[:3], other_city, *answers])
        assert error.param == "input[3]" and "diverged on replay" in error.message

        forged = {**items[1], "fingerprint": "ptc1.x"}
        error = await refusal([QUESTION, forged, *items[2:], *answers])
        assert error.param == "input[1].fingerprint"
        assert len(engine.requests) == 1  # no refused request reached the engine

        # Outputs matched by call id resume the program without their call items too.
        resumed = await client.responses.create(
            model=MODEL, input=[QUESTION, items[1], *answers], tools=TOOLS, store=False
        )
        check_resumed(resumed, first.output[0].call_id)


def test_the_program_tool_lists_only_programmatic_functions():
    canon = sorted_tools(TOOLS)
    assert [(t["type"], t["name"]) for t in canon] == [
        ("namespace", "geo"),
        ("custom", PROGRAM_TOOL_NAME),
    ]
    lines = canon[1]["description"].split("\n")
    assert lines[1:] == [
        "tools.geo__distance({a?: string}) - Distance in km.",
        "tools.get_weather({city?: string}) - Weather of a city.",
    ]
    assert "10 s" in lines[0] and "text(...)" in lines[0] and "Promise.all" in lines[0]
    only_direct = [{"type": "programmatic_tool_calling"}, {**WEATHER, "allowed_callers": None}]
    assert sorted_tools(only_direct)[1]["description"].endswith("Tools:\n(none)")


def test_a_fingerprint_pins_the_replay_and_the_code():
    fingerprint = new_fingerprint("return 1", epoch_ms=1234, seed=7)
    determinism = replay_determinism(fingerprint, "return 1")
    assert (determinism.epoch_ms, determinism.seed) == (1234, 7)
    with pytest.raises(FingerprintMismatch) as changed:
        replay_determinism(fingerprint, "return 2")
    assert changed.value.field == "code"
    tampered = fingerprint.replace(".7.", ".8.")
    with pytest.raises(FingerprintMismatch):
        replay_determinism(tampered, "return 1")
