"""WebSocket mode on /v1/responses, end to end, with the SDK's own client.

`client.responses.connect()` opens the socket and `connection.response.create(...)` sends
`response.create` events; `send_raw` puts frames on the wire that no typed call would
send (garbage text, binary). The yardstick for the continuation chain is a stateless
HTTP client on a fresh gateway with the same scripted outputs: the engine must receive
exactly the same prompts.
"""

import asyncio
from dataclasses import replace

import openai
import pytest
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

from once.gateway.config import GatewayConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway
from tests.gateway.test_http import (
    CHAIN_TEXTS,
    CHAIN_TURNS,
    INSTRUCTIONS,
    TOOLS,
    as_input,
    client_for,
    metric,
    stateless_prompts,
    user,
    validate_events,
)

CONFIG = GatewayConfig(store="memory", verify_every=1)
FINAL = ("response.completed", "response.incomplete", "response.failed", "error")


async def until_final(connection, timeout_s: float = 10) -> list:
    """Events up to and including the next final one (a terminal response event or error)."""
    events = []
    async with asyncio.timeout(timeout_s):
        async for event in connection:
            events.append(event)
            if event.type in FINAL:
                validate_events(events)
                return events
    raise AssertionError(f"the connection closed after {[e.type for e in events]}")


async def completed(connection) -> object:
    events = await until_final(connection)
    assert events[-1].type == "response.completed", events[-1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response


async def error_of(connection):
    events = await until_final(connection)
    assert [e.type for e in events] == ["error"], [e.type for e in events]
    return events[0]


# -- 1. the incremental chain equals a stateless resend ----------------------------------


async def test_chain_of_new_items_gives_the_prompts_of_full_resends(runtime):
    engine = scripted_texts(runtime, CHAIN_TEXTS)
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL,
                instructions=INSTRUCTIONS,
                tools=TOOLS,
                input=CHAIN_TURNS[0](None),
                store=False,
            )
            previous = await completed(connection)
            texts = [previous.output_text]
            for new_items in CHAIN_TURNS[1:]:
                # Only the id and the new items: the rest is inherited from the connection.
                await connection.response.create(
                    previous_response_id=previous.id, input=new_items(previous)
                )
                previous = await completed(connection)
                assert previous.model == MODEL and previous.instructions == INSTRUCTIONS
                assert [tool.name for tool in previous.tools] == ["shell", "read_file"]
                texts.append(previous.output_text)
        with pytest.raises(openai.NotFoundError):  # store false: nothing was stored
            await client.responses.retrieve(previous.id)
        assert texts[2:] == CHAIN_TEXTS[2:]

        assert metric(gateway, "renders", "full") == 1
        assert metric(gateway, "renders", "incremental") == 3
        assert metric(gateway, "verifications") == 3
        assert metric(gateway, "divergences") == 0
        prompt_tokens = metric(gateway, "prompt_tokens")
        assert prompt_tokens == sum(len(r.prompt_token_ids) for r in engine.requests)
        # Each continuation tokenized only its new items, not the conversation again.
        assert metric(gateway, "tokenized_tokens") < prompt_tokens / 2
    chained = [list(r.prompt_token_ids) for r in engine.requests]

    stateless = await stateless_prompts(
        runtime, CHAIN_TEXTS, CHAIN_TURNS, instructions=INSTRUCTIONS, tools=TOOLS
    )
    assert len(chained) == len(stateless) == 4
    for turn, (chain_prompt, full_prompt) in enumerate(zip(chained, stateless, strict=True)):
        assert chain_prompt == full_prompt, f"turn {turn} differs"


async def test_changed_instructions_or_tools_render_in_full_and_match_a_resend(runtime):
    texts = ["A one.", "B two.", "C three."]
    # Each turn: the fields it changes, and its new items. Omitted fields are inherited.
    turns = [
        ({"instructions": "First."}, [user("q1")]),
        ({"instructions": "Second."}, [user("q2")]),
        ({"tools": TOOLS}, [user("q3")]),
    ]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            previous = None
            for changes, new_items in turns:
                if previous is None:
                    await connection.response.create(
                        model=MODEL, store=False, input=new_items, **changes
                    )
                else:
                    await connection.response.create(
                        previous_response_id=previous.id, input=new_items, **changes
                    )
                previous = await completed(connection)
        assert previous.instructions == "Second." and len(previous.tools) == 2
        assert metric(gateway, "renders", "full") == 3

    resend_engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, resend_engine) as (url, _), client_for(url) as client:
        items, fields, previous = [], {}, None
        for changes, new_items in turns:
            fields.update(changes)
            items += (as_input(previous) if previous else []) + new_items
            previous = await client.responses.create(
                model=MODEL, input=items, store=False, **fields
            )
    for turn, (chained, resent) in enumerate(
        zip(engine.requests, resend_engine.requests, strict=True)
    ):
        assert chained.prompt_token_ids == resent.prompt_token_ids, f"turn {turn} differs"


# -- 2. unknown previous_response_id ------------------------------------------------------


async def test_unknown_previous_response_is_an_error_frame_and_the_connection_lives(runtime):
    engine = scripted_texts(runtime, ["Recovered."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL, previous_response_id="resp_doesnotexist", input=[user("Go on.")]
            )
            error = await error_of(connection)
            assert error.status == 400
            assert error.error.code == "previous_response_not_found"
            assert error.error.param == "previous_response_id"

            # The recovery a client does: resend the full input.
            await connection.response.create(model=MODEL, input=[user("Start over.")])
            assert (await completed(connection)).output_text == "Recovered."
    assert len(engine.requests) == 1


# -- 3. one response in flight per connection ---------------------------------------------


async def test_second_create_while_one_is_in_flight_is_refused(runtime):
    slow_text = "one two three four five six seven eight nine ten"
    engine = scripted_texts(runtime, [slow_text, "Next."], token_latency_s=0.05)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(model=MODEL, input="Count slowly.", store=False)
            first = await connection.recv()
            assert first.type == "response.created"
            await connection.response.create(model=MODEL, input="Me too!", stream_id="lane-2")
            events = [first] + await until_final(connection)
            busy = [e for e in events if e.type == "error"]
            assert len(busy) == 1
            assert busy[0].status == 409
            assert busy[0].error.code == "response_already_in_progress"
            assert busy[0].stream_id == "lane-2"
            # The first response was not disturbed by the refusal.
            if events[-1].type == "error":
                events += await until_final(connection)
            assert events[-1].type == "response.completed"
            assert events[-1].response.output_text == slow_text
            sequence = [e.sequence_number for e in events if e.type != "error"]
            assert sequence == list(range(len(sequence)))

            await connection.response.create(model=MODEL, input="And now?")
            assert (await completed(connection)).output_text == "Next."
    assert len(engine.requests) == 2  # the refused request never reached the engine
    assert "Me too!" not in runtime.tokenizer.decode(engine.requests[1].prompt_token_ids)


# -- 4. garbage frames --------------------------------------------------------------------


async def test_garbage_frames_get_error_frames_and_the_connection_serves_on(runtime):
    engine = scripted_texts(runtime, ["Unharmed."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        async with client.responses.connect() as connection:
            garbage = [
                ("{not json", "invalid_json", None),
                (b"\x00\xffbinary\x80", "invalid_request", None),
                ("[1, 2, 3]", "invalid_request", "type"),
                ('"response.create"', "invalid_request", "type"),
                ('{"type": "response.bogus"}', "invalid_request", "type"),
                (
                    '{"type": "response.create", "model": 5, "input": "x"}',
                    "invalid_request",
                    "model",
                ),
                (
                    '{"type": "response.create", "model": "nope", "input": "x"}',
                    "model_not_found",
                    "model",
                ),
            ]
            for frame, code, param in garbage:
                await connection.send_raw(frame)
                error = await error_of(connection)
                assert (error.error.code, error.error.param) == (code, param), frame
                assert error.status in (400, 404)
            # The SDK's typed call cannot carry unknown fields; a plain event dict can.
            create = {"type": "response.create", "model": MODEL, "input": "hi"}
            await connection.send({**create, "temperature": "hot"})
            bad_type = await error_of(connection)
            assert (bad_type.status, bad_type.error.param) == (400, "temperature")

            await connection.send({**create, "unknown_field": {"x": 1}})
            assert (await completed(connection)).output_text == "Unharmed."


# -- 5. generate: false warm-up -----------------------------------------------------------


async def test_warm_up_then_continue_gives_the_prompt_of_a_full_render(runtime):
    # The warm-up also reaches the engine (a one-token prefill) and consumes a script entry.
    engine = scripted_texts(runtime, ["(never shown)", "Warm answer."])
    first_turn = [user("Here is a long task description to prefill ahead of time.")]
    second_turn = [user("Now do it.")]
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL,
                instructions=INSTRUCTIONS,
                tools=TOOLS,
                input=first_turn,
                store=False,
                generate=False,
            )
            events = await until_final(connection)
            assert [e.type for e in events] == [
                "response.created",
                "response.in_progress",
                "response.completed",
            ]
            warm = events[-1].response
            assert warm.output == [] and warm.usage.output_tokens == 0
            assert engine.requests[0].sampling.max_tokens == 1

            await connection.response.create(previous_response_id=warm.id, input=second_turn)
            answer = await completed(connection)
            assert answer.output_text == "Warm answer."
            assert answer.usage.input_tokens_details.cached_tokens > 0
    continued = list(engine.requests[1].prompt_token_ids)

    full = await stateless_prompts(
        runtime,
        ["Warm answer."],
        [lambda _: first_turn + second_turn],
        instructions=INSTRUCTIONS,
        tools=TOOLS,
    )
    assert continued == full[0]


# -- 6. connection age limit --------------------------------------------------------------


async def test_connection_past_its_age_limit_is_told_and_closed(runtime):
    engine = scripted_texts(runtime, [])
    config = replace(CONFIG, websocket_max_age_s=0)
    async with serve_gateway(runtime, engine, config) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(model=MODEL, input="hi")
            error = await error_of(connection)
            assert error.error.code == "websocket_connection_limit_reached"
            with pytest.raises(ConnectionClosed):
                await connection.recv()
        assert engine.requests == []
        async with asyncio.timeout(5):  # the server side unwinds after the close
            while gateway.metrics.websocket_connections._value.get() != 0:
                await asyncio.sleep(0.01)


# -- 7. bad API key -----------------------------------------------------------------------


async def test_bad_api_key_gets_a_401_frame_then_the_socket_closes(runtime, tmp_path):
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[[keys]]\nkey = "sk-good-0123456789"\ntenant = "acme"\n')
    config = replace(CONFIG, api_keys_file=str(keys_file))
    engine = scripted_texts(runtime, ["Welcome."])
    async with serve_gateway(runtime, engine, config) as (url, _):
        async with client_for(url, "sk-bad-0123456789") as client:
            async with client.responses.connect() as connection:
                error = await error_of(connection)
                assert error.status == 401 and error.error.code == "invalid_api_key"
                with pytest.raises(ConnectionClosedError) as closed:
                    await connection.recv()
                assert closed.value.rcvd.code == 1008
        async with client_for(url, "sk-good-0123456789") as client:
            async with client.responses.connect() as connection:
                await connection.response.create(model=MODEL, input="hi")
                assert (await completed(connection)).output_text == "Welcome."
    assert [r.cache_salt for r in engine.requests] == ["acme"]


# -- 8. continuing another connection's stored response -----------------------------------


async def test_stored_response_continues_on_another_connection(runtime):
    texts = ["First answer.", "Second answer."]
    engine = scripted_texts(runtime, texts)
    first_turn, second_turn = [user("Question one?")], [user("Question two?")]
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(
                model=MODEL,
                instructions=INSTRUCTIONS,
                tools=TOOLS,
                input=first_turn,
                store=True,
                temperature=0.5,
            )
            stored = await completed(connection)
        async with client.responses.connect() as connection:
            await connection.response.create(previous_response_id=stored.id, input=second_turn)
            answer = await completed(connection)
        assert answer.output_text == "Second answer."
        assert answer.model == MODEL and answer.instructions == INSTRUCTIONS
        assert answer.temperature == 0.5 and len(answer.tools) == 2
        assert answer.previous_response_id == stored.id
        assert engine.requests[1].sampling.temperature == 0.5
        assert metric(gateway, "renders", "incremental") == 1
        assert metric(gateway, "divergences") == 0
    continued = list(engine.requests[1].prompt_token_ids)

    full = await stateless_prompts(
        runtime,
        texts,
        [lambda _: first_turn, lambda _: second_turn],
        instructions=INSTRUCTIONS,
        tools=TOOLS,
    )
    assert continued == full[1]


# -- a client that goes away ---------------------------------------------------------------


async def test_closing_the_socket_mid_response_aborts_the_engine_request(runtime):
    slow_text = "one two three four five six seven eight nine ten eleven twelve"
    engine = scripted_texts(runtime, [slow_text, "Next."], token_latency_s=0.05)
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        async with client.responses.connect() as connection:
            await connection.response.create(model=MODEL, input="Count.")
            assert (await connection.recv()).type == "response.created"
        request_id = engine.requests[0].request_id
        async with asyncio.timeout(5):
            while engine.finish_reasons.get(request_id) != "abort":
                await asyncio.sleep(0.01)
        async with client.responses.connect() as connection:
            await connection.response.create(model=MODEL, input="Hi.")
            assert (await completed(connection)).output_text == "Next."
        async with asyncio.timeout(5):  # the handler's finally runs after its last send
            while gateway.metrics.inflight._value.get() != 0:
                await asyncio.sleep(0.01)
