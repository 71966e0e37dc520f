"""Incremental tokenization: a continuation's prompt ids equal a full render's.

The equality holds when the sampled ids are the canonical tokenization of the sampled text
(the scripted engine's outputs are); where they are not, the service's verification must
notice, count it and render that chain in full from then on.
"""

import asyncio
import threading
from dataclasses import replace

import openai
import pytest
from prometheus_client import CollectorRegistry

from once.bench.payloads import (
    chains,
    full_request_reason,
    incremental_request,
    session_requests,
)
from once.bench.traces import (
    CODER,
    MINI_SWE_AGENT,
    SWEAGENT_1_0,
    SWEAGENT_1_1,
    default_traces_dir,
    load_session,
)
from once.gateway.app import create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.pipeline import ResponsePipeline
from once.gateway.prepare import INLINE_RENDER_CHARS
from once.gateway.prompt.render import NotIncrementalError
from once.gateway.prompt.tokens import FULL, INCREMENTAL, ConversationState
from once.gateway.state.conversation import ConnectionCache
from once.gateway.testing import prepare_request, response_events
from once.protocol.errors import PreviousResponseNotFoundError
from once.protocol.scripted_engine import ScriptedEngine
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

KEY = "test"
MAX_CALLS_PER_CHAIN = 15
# Small sessions of every source, by name, so the walk is the same on every run.
SESSIONS = [
    (MINI_SWE_AGENT, "mini-swe-agent__gemini-3-pro-preview/django__django-11179.traj.json"),
    (MINI_SWE_AGENT, "mini-swe-agent__gemini-3-pro-preview/django__django-15741.traj.json"),
    (SWEAGENT_1_1, "sweagent__claude-sonnet-4-20250514/sympy__sympy-13372.traj"),
    (CODER, "coder__gpt-4/pytest-dev__pytest-5227.traj"),
    (CODER, "coder__gpt-4/django__django-10914.traj"),
    # Outputs that start with whitespace: the stated exception (see the test).
    (SWEAGENT_1_0, "sweagent__swe-agent-lm-32b/sympy__sympy-19783.traj"),
]


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def output_ids(runtime, output_items) -> list[int]:
    """Canonical sampled ids for an output: its rendered assistant text, encoded, + eos."""
    [message] = runtime.renderer.item_messages(output_items)
    assert message["role"] == "assistant"
    return runtime.builder.encode(message["content"]) + [runtime.tokenizer.eos_token_id]


# -- 1. recorded sessions -------------------------------------------------------------------


@pytest.mark.parametrize(("source", "relative_path"), SESSIONS, ids=[s[1] for s in SESSIONS])
def test_continuations_of_recorded_sessions_equal_full_renders(runtime, source, relative_path):
    path = default_traces_dir() / relative_path
    if not path.is_file():
        pytest.skip(f"no agent trace at {path} (set ONCE_SHARED_DATA)")
    session = load_session(path)
    assert session.source == source
    builder = runtime.builder
    requests = session_requests(session)
    num_checked = 0
    for positions in chains(session).values():
        state, previous = None, None
        for position in positions[:MAX_CALLS_PER_CHAIN]:
            request, output = requests[position]
            tools = request.get("tools") or []
            instructions = request.get("instructions")
            full = builder.full(KEY, instructions, tools, request["input"])
            reason = full_request_reason(*previous, request) if previous else "first_call"
            built = full
            if reason is None:
                new_items = incremental_request(*previous, request, "resp_x")["input"]
                built = builder.continuation(state, tools, new_items)
                assert built.mode == INCREMENTAL
                assert built.num_tokenized == len(built.prompt_ids) - len(state.token_ids)
                # The rule where ids differ: an output that starts with whitespace merges
                # with the generation prompt's "\n" when the text is tokenized whole.
                previous_text = runtime.renderer.item_messages(previous[1])[0]["content"]
                if previous_text[:1].isspace():
                    assert built.prompt_ids != full.prompt_ids, position
                    built = full  # as the service does after a failed verification
                else:
                    assert built.prompt_ids == full.prompt_ids, position
                    assert built.context_ids == full.context_ids
                num_checked += 1
            state = ConversationState(KEY, built.prompt_ids + output_ids(runtime, output), True)
            previous = (request, output)
    assert num_checked >= 3


# -- the builder alone ----------------------------------------------------------------------


def test_non_canonical_sampled_ids_make_the_continuation_differ(runtime):
    builder = runtime.builder
    first = [user("Say hello.")]
    reply = "Hello there, friend!"
    built = builder.full(KEY, "sys", [], first)
    per_char = [i for char in reply for i in builder.encode(char)]
    assert per_char != builder.encode(reply)  # the premise: a different tokenization
    state = ConversationState(KEY, built.prompt_ids + per_char + [2], after_output=True)
    new_items = [user("Again.")]
    continued = builder.continuation(state, [], new_items)
    output = {"type": "message", "role": "assistant", "content": reply}
    full = builder.full(KEY, "sys", [], [*first, output, *new_items])
    assert continued.prompt_ids != full.prompt_ids
    assert runtime.tokenizer.decode(continued.prompt_ids) == runtime.tokenizer.decode(
        full.prompt_ids
    )  # the same text: only the ids differ


def test_a_leading_function_call_is_never_continued_incrementally(runtime):
    builder = runtime.builder
    items = [user("hi"), {"type": "message", "role": "assistant", "content": "Let me see."}]
    built = builder.full(KEY, None, [], items)
    call = {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"}
    # After output: the call would join the model's open turn.
    after_output = ConversationState(KEY, built.prompt_ids + [2], after_output=True)
    with pytest.raises(NotIncrementalError):
        builder.continuation(after_output, [], [call])
    # After a warm-up ending with an assistant message, a full render joins the call to it.
    warm = ConversationState(KEY, built.context_ids, after_output=False)
    with pytest.raises(NotIncrementalError):
        builder.continuation(warm, [], [{"type": "reasoning", "summary": []}, call])
    with pytest.raises(NotIncrementalError):
        builder.continuation(replace(warm, needs_full_render=True), [], [user("x")])


# -- through the service --------------------------------------------------------------------


def make_service(runtime, engine, verify_every: int = 1) -> ResponsePipeline:
    config = GatewayConfig(store="memory", store_ttl_s=3600, verify_every=verify_every)
    return create_gateway(config, engine, {MODEL: runtime}, CollectorRegistry())


async def respond(service, connection, **body):
    """One response through prepare + stream; returns (prepared, events)."""
    prepared = await prepare_request(service, {"model": MODEL, **body}, connection)
    events = [event async for event in response_events(service, prepared)]
    return prepared, events


def renders(service, mode: str) -> float:
    return service.metrics.value(service.metrics.renders, mode)


async def test_divergence_is_counted_and_the_chain_renders_in_full_next(runtime):
    """Over HTTP with the SDK: the store path (no connection state)."""
    eos = runtime.tokenizer.eos_token_id
    reply = "Hello there, friend!"
    per_char = [i for char in reply for i in runtime.builder.encode(char)] + [eos]
    canonical = [runtime.builder.encode(text) + [eos] for text in ("Fine.", "Bye.")]
    engine = ScriptedEngine([per_char, *canonical], eos_token_id=eos)
    async with serve_gateway(runtime, engine) as (url, gateway):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)
        metrics = gateway.metrics
        first = await client.responses.create(model=MODEL, instructions="sys", input="Say hello.")
        assert first.output_text == reply
        second = await client.responses.create(
            model=MODEL, instructions="sys", input="Again.", previous_response_id=first.id
        )
        assert metrics.value(metrics.renders, "incremental") == 1
        await gateway.drain_verifications()  # verification runs in the background
        assert metrics.value(metrics.verifications) == 1
        assert metrics.value(metrics.divergences) == 1
        full_renders = metrics.value(metrics.renders, "full")
        third = await client.responses.create(
            model=MODEL, instructions="sys", input="Once more.", previous_response_id=second.id
        )
        assert third.output_text == "Bye."
        assert metrics.value(metrics.renders, "full") == full_renders + 1
        assert metrics.value(metrics.renders, "incremental") == 1
        await client.close()
    history = [
        user("Say hello."),
        {"type": "message", "role": "assistant", "content": reply},
        user("Again."),
    ]
    builder = runtime.builder
    second_full = builder.full(KEY, "sys", [], history)
    assert list(engine.requests[1].prompt_token_ids) != second_full.prompt_ids  # sampled ids
    history += [{"type": "message", "role": "assistant", "content": "Fine."}, user("Once more.")]
    third_full = builder.full(KEY, "sys", [], history)
    assert list(engine.requests[2].prompt_token_ids) == third_full.prompt_ids


async def test_a_diverged_chain_recovers_on_a_connection(runtime):
    """The same over a connection's own state: full once, then incremental again."""
    eos = runtime.tokenizer.eos_token_id
    per_char = [i for char in "Hi you" for i in runtime.builder.encode(char)] + [eos]
    engine = scripted_texts(runtime, ["unused", "Fine.", "Good.", "Done."])
    engine.script[0] = per_char
    service, connection = make_service(runtime, engine), ConnectionCache()
    first, _ = await respond(service, connection, input="a")
    second, _ = await respond(
        service, connection, input="b", previous_response_id=first.response_id
    )
    assert second.built.mode == INCREMENTAL
    await service.drain_verifications()  # verification runs in the background
    assert service.metrics.value(service.metrics.divergences) == 1
    third, _ = await respond(
        service, connection, input="c", previous_response_id=second.response_id
    )
    assert third.built.mode == FULL
    fourth, events = await respond(
        service, connection, input="d", previous_response_id=third.response_id
    )
    assert events[-1]["type"] == "response.completed"
    assert fourth.built.mode == INCREMENTAL  # the full render re-based the chain
    await service.drain_verifications()
    assert service.metrics.value(service.metrics.divergences) == 1
    assert service.metrics.value(service.metrics.verifications) == 2
    expected = runtime.builder.full(KEY, None, [], fourth.items)
    assert list(engine.requests[3].prompt_token_ids) == expected.prompt_ids


async def test_output_cut_by_max_tokens_continues_with_the_turn_closed(runtime):
    engine = scripted_texts(runtime, ["one two three four five six seven eight", "ok"])
    service, connection = make_service(runtime, engine), ConnectionCache()
    first, events = await respond(service, connection, input="count", max_output_tokens=4)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    sampled = list(engine.requests[0].prompt_token_ids)
    cut_text = events[-1]["response"]["output"][0]["content"][0]["text"]
    assert cut_text == "one two three four"
    second, events = await respond(
        service, connection, input="go on", previous_response_id=first.response_id
    )
    assert second.built.mode == INCREMENTAL
    assert events[-1]["type"] == "response.completed"
    prompt = list(engine.requests[1].prompt_token_ids)
    num_kept = len(sampled) + 4
    assert prompt[num_kept] == runtime.tokenizer.eos_token_id  # <|im_end|> closes the turn
    history = [user("count"), {"type": "message", "role": "assistant", "content": cut_text}]
    expected = runtime.builder.full(KEY, None, [], [*history, user("go on")])
    assert prompt == expected.prompt_ids
    await service.drain_verifications()
    assert service.metrics.value(service.metrics.divergences) == 0


@pytest.mark.parametrize("via", ["connection", "store"])
async def test_a_warm_up_state_continues_correctly(runtime, via):
    engine = scripted_texts(runtime, ["x", "Sure."])
    service = make_service(runtime, engine)
    connection = ConnectionCache() if via == "connection" else None
    items = [user("Read this file."), {"type": "message", "role": "assistant", "content": "Ok."}]
    body = {"input": items, "instructions": "sys", "generate": False}
    if connection is None:
        warm = await prepare_request(service, {"model": MODEL, **body}, ConnectionCache())
        warm.connection = None  # a WebSocket-mode request whose state only the store keeps
        events = [event async for event in response_events(service, warm)]
    else:
        warm, events = await respond(service, connection, **body)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"] == []
    assert engine.requests[0].sampling.max_tokens == 1
    second, events = await respond(
        service,
        connection,
        input="Now summarize it.",
        instructions="sys",
        previous_response_id=warm.response_id,
    )
    assert second.built.mode == INCREMENTAL
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Sure."
    expected = runtime.builder.full(KEY, "sys", [], [*items, user("Now summarize it.")])
    assert list(engine.requests[1].prompt_token_ids) == expected.prompt_ids
    assert second.built.num_tokenized < len(expected.prompt_ids) // 2
    await service.drain_verifications()
    assert service.metrics.value(service.metrics.divergences) == 0


TOOL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    "change", [{"instructions": "other"}, {"tools": [TOOL]}, {"instructions": None}]
)
async def test_changed_instructions_or_tools_render_in_full(runtime, change):
    engine = scripted_texts(runtime, ["A.", "B.", "C."])
    service, connection = make_service(runtime, engine), ConnectionCache()
    first, _ = await respond(service, connection, input="one", instructions="sys")
    second, _ = await respond(
        service, connection, input="two", instructions="sys", previous_response_id=first.response_id
    )
    assert second.built.mode == INCREMENTAL
    body = {"instructions": "sys", **change}
    third, _ = await respond(
        service, connection, input="three", previous_response_id=second.response_id, **body
    )
    assert third.built.mode == FULL
    assert renders(service, "full") == 2 and renders(service, "incremental") == 1
    history = [user("one"), {"type": "message", "role": "assistant", "content": "A."}]
    history += [user("two"), {"type": "message", "role": "assistant", "content": "B."}]
    expected = runtime.builder.full(
        KEY, body["instructions"], body.get("tools", []), [*history, user("three")]
    )
    assert list(engine.requests[2].prompt_token_ids) == expected.prompt_ids


async def test_unknown_previous_response_is_not_found(runtime):
    service = make_service(runtime, scripted_texts(runtime, []))
    for connection in (None, ConnectionCache()):
        with pytest.raises(PreviousResponseNotFoundError) as error:
            await respond(service, connection, input="x", previous_response_id="resp_nope")
        assert error.value.param == "previous_response_id"
    assert service.engine.requests == []


# -- the state is saved before the final event -----------------------------------------------


async def test_a_chain_continues_as_soon_as_the_final_event_arrives(runtime):
    engine = scripted_texts(runtime, ["A.", "B."])
    service, connection = make_service(runtime, engine), ConnectionCache()
    for via in (connection, None):  # the connection's state, then the store's
        prepared = await prepare_request(service, {"model": MODEL, "input": "q1"}, via)
        stream = response_events(service, prepared)
        async for event in stream:
            if event["type"] == "response.completed":
                break  # a client sends its next request now, before the stream is drained
        body = {"model": MODEL, "input": "q2", "previous_response_id": prepared.response_id}
        continued = await prepare_request(service, body, via)
        assert continued.built.mode == INCREMENTAL
        await stream.aclose()


async def test_a_websocket_continuation_right_after_completed_is_not_refused(runtime):
    """A slow store (Redis, a busy SQLite) once left the response "in flight" after its
    final event, so a fast client's next response.create got response_already_in_progress."""
    engine = scripted_texts(runtime, ["A.", "B."])
    async with serve_gateway(runtime, engine) as (url, gateway):
        store = gateway.store
        put = store.put

        async def slow_put(record):
            await asyncio.sleep(0.2)
            await put(record)

        store.put = slow_put
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)
        async with client.responses.connect() as socket:
            await socket.response.create(model=MODEL, input="q1")
            first = await final_event(socket)
            await socket.response.create(previous_response_id=first.response.id, input="q2")
            second = await final_event(socket)
        await client.close()
    assert second.type == "response.completed", second
    assert second.response.output_text == "B."


async def final_event(socket, timeout_s: float = 10):
    async with asyncio.timeout(timeout_s):
        async for event in socket:
            if event.type in ("response.completed", "response.incomplete", "error"):
                return event
    raise AssertionError("the connection closed before a final event")


# -- render and tokenize off the event loop --------------------------------------------------


@pytest.mark.parametrize("num_chars", [20, 4 * INLINE_RENDER_CHARS])
async def test_long_renders_run_off_the_event_loop(runtime, num_chars):
    """The loop keeps streaming other responses while a long prompt is built."""
    service = make_service(runtime, scripted_texts(runtime, []))
    threads = []
    build = runtime.builder.full

    def full(*args):
        threads.append(threading.current_thread())
        return build(*args)

    runtime.builder.full = full
    try:
        prepared = await prepare_request(service, {"model": MODEL, "input": "x" * num_chars})
    finally:
        del runtime.builder.full
    assert prepared.built.prompt_ids == build(KEY, None, [], [user("x" * num_chars)]).prompt_ids
    on_loop = threads == [threading.main_thread()]
    assert on_loop == (num_chars <= INLINE_RENDER_CHARS)
