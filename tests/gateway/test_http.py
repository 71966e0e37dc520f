"""The gateway's HTTP+SSE API, end to end, with the official `openai` SDK as the client.

Each test starts a real gateway (uvicorn on a loopback port) around a `ScriptedEngine`
that plays canned outputs, canonically tokenized; what the engine received
(`engine.requests[i].prompt_token_ids`) is the ground truth for rendering. Raw `httpx`
is used only for inputs the SDK cannot send (malformed JSON, invalid UTF-8, a chunked
oversized body) and for the non-API endpoints.
"""

import asyncio
import base64
import io
import json
from dataclasses import replace

import httpx
import openai
import pytest
from openai.types.responses import Response

from once.gateway.config import GatewayConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

INSTRUCTIONS = "You are a terse coding assistant."
TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        "strict": False,
    },
]
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
CONFIG = GatewayConfig(store="memory", verify_every=1)


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call in the canonical form the renderer writes (and a stateless resend gives)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def valid_response(response) -> Response:
    """The SDK builds its objects without validation: validate what the server sent."""
    return Response.model_validate(response.to_dict())


def validate_events(events) -> None:
    # The SDK picked each event's class by its `type`; every field must fit that class.
    for event in events:
        type(event).model_validate(event.to_dict())


def client_for(url: str, api_key: str = "sk-test") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=10)


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def as_input(response) -> list[dict]:
    """A response's output items as the next request's input items (what a client appends)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def tool_outputs(response, outputs: list[str]) -> list[dict]:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == len(outputs)
    return [
        {"type": "function_call_output", "call_id": call.call_id, "output": output}
        for call, output in zip(calls, outputs, strict=True)
    ]


def metric(gateway, name: str, *labels) -> float:
    metrics = gateway.metrics
    return metrics.value(getattr(metrics, name), *labels)


async def stateless_prompts(runtime, texts, turns, **request) -> list[list[int]]:
    """The engine prompts of a stateless client on a fresh gateway: every turn resends the
    whole conversation (store false, no previous_response_id). `turns[k]` maps the
    previous response (None at first) to the new items of turn k."""
    engine = scripted_texts(runtime, texts)
    full_renders_only = replace(CONFIG, stateless_states=0)  # the reference renders in full
    async with (
        serve_gateway(runtime, engine, full_renders_only) as (url, gateway),
        client_for(url) as client,
    ):
        items: list[dict] = []
        previous = None
        for new_items in turns:
            if previous is not None:
                items += as_input(previous)
            items += new_items(previous)
            previous = await client.responses.create(
                model=MODEL, input=items, store=False, **request
            )
        assert metric(gateway, "renders", "incremental") == 0
    return [list(r.prompt_token_ids) for r in engine.requests]


# -- 1. a plain create --------------------------------------------------------------------


async def test_create_reports_usage_from_the_engine_and_retrieve_returns_it(runtime):
    texts = ["Hello there! How can I help?", "Sure."]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        first = await client.responses.create(
            model=MODEL, input="Say hello, please.", instructions=INSTRUCTIONS
        )
        assert isinstance(first, Response)
        valid_response(first)
        assert first.status == "completed"
        assert first.output_text == texts[0]
        assert first.model == MODEL and first.instructions == INSTRUCTIONS
        first_prompt = engine.requests[0].prompt_token_ids
        first_output = runtime.builder.encode(texts[0]) + [runtime.tokenizer.eos_token_id]
        assert first.usage.input_tokens == len(first_prompt)
        assert first.usage.input_tokens_details.cached_tokens == 0
        assert first.usage.input_tokens_details.cache_write_tokens == len(first_prompt)
        assert first.usage.output_tokens == len(first_output)
        assert first.usage.total_tokens == len(first_prompt) + len(first_output)

        retrieved = await client.responses.retrieve(first.id)
        assert retrieved.model_dump() == first.model_dump()

        second = await client.responses.create(
            model=MODEL, input="Again.", previous_response_id=first.id, instructions=INSTRUCTIONS
        )
        assert second.output_text == texts[1]
        second_prompt = engine.requests[1].prompt_token_ids
        assert second_prompt[: len(first_prompt) + len(first_output)] == (
            tuple(first_prompt) + tuple(first_output)
        )
        # The engine caches full 16-token blocks of prompt + output (bar the last token).
        expected_cached = (len(first_prompt) + len(first_output) - 1) // 16 * 16
        assert second.usage.input_tokens == len(second_prompt)
        assert second.usage.input_tokens_details.cached_tokens == expected_cached > 0
        assert second.usage.input_tokens_details.cache_write_tokens == (
            len(second_prompt) - expected_cached
        )


# -- 2. streaming -------------------------------------------------------------------------


async def test_stream_events_in_order_with_exact_multibyte_deltas(runtime):
    text = "Voilà: 😀 你好，世界! 🎉🇯🇵 naïve — ok."
    # Its emoji and CJK characters span several tokens each. A small per-token latency
    # keeps the gateway from coalescing deltas, so partial characters really reach it.
    engine = scripted_texts(runtime, [text], token_latency_s=0.005)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        stream = await client.responses.create(model=MODEL, input="Greet me.", stream=True)
        events = [event async for event in stream]

    validate_events(events)
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 10  # really streamed, a few tokens at a time
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == TEXT_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert all("\ufffd" not in delta for delta in deltas)  # no half characters
    assert "".join(deltas) == text
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text
    assert events[0].response.status == "in_progress" and events[0].response.output == []


# -- 3. function tools and continuations --------------------------------------------------


CHAIN_TEXTS = [
    "Let me look.\n" + tool_call_text("shell", {"cmd": "ls -la"}),
    tool_call_text("read_file", {"path": "a.py"}),
    "a.py prints 你好 😀 and exits.",
    "You're welcome.",
]
CHAIN_TURNS = [
    lambda previous: [user("What does a.py do?")],
    lambda previous: tool_outputs(previous, ["a.py\nb.txt"]),
    lambda previous: tool_outputs(previous, ["print('你好 😀')"]),
    lambda previous: [user("Thanks!")],
]


async def test_tool_calls_and_continuations_equal_a_stateless_full_resend(runtime):
    engine = scripted_texts(runtime, CHAIN_TEXTS)
    request = {"instructions": INSTRUCTIONS, "tools": TOOLS}
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        stream = await client.responses.create(
            model=MODEL, input=CHAIN_TURNS[0](None), stream=True, **request
        )
        events = [event async for event in stream]
        validate_events(events)
        first = events[-1].response
        kinds = [item.type for item in first.output]
        assert kinds == ["message", "function_call"]
        assert first.output[0].content[0].text == "Let me look."
        call = first.output[1]
        assert call.name == "shell" and json.loads(call.arguments) == {"cmd": "ls -la"}
        assert call.call_id and call.status == "completed"
        types = [event.type for event in events]
        args_delta = next(e for e in events if e.type == "response.function_call_arguments.delta")
        args_done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert args_delta.item_id == args_done.item_id == call.id
        assert args_done.arguments == call.arguments and args_done.name == "shell"
        at = types.index("response.function_call_arguments.delta")
        assert types[at - 1 : at + 3] == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert types[-1] == "response.completed"

        previous, texts = first, [first.output_text]
        for new_items in CHAIN_TURNS[1:]:
            previous = await client.responses.create(
                model=MODEL,
                input=new_items(previous),
                previous_response_id=previous.id,
                **request,
            )
            texts.append(previous.output_text)
        assert [item.type for item in previous.output] == ["message"]
        assert texts[1:] == ["", CHAIN_TEXTS[2], CHAIN_TEXTS[3]]
        assert metric(gateway, "renders", "incremental") == 3
        assert metric(gateway, "verifications") == 3
        assert metric(gateway, "divergences") == 0
    chained = [list(r.prompt_token_ids) for r in engine.requests]

    stateless = await stateless_prompts(runtime, CHAIN_TEXTS, CHAIN_TURNS, **request)
    assert len(chained) == len(stateless) == 4
    for turn, (chain_prompt, full_prompt) in enumerate(zip(chained, stateless, strict=True)):
        assert chain_prompt == full_prompt, f"turn {turn} differs"
    rendered = runtime.tokenizer.decode(chained[-1])
    assert "<tool_response>\nprint('你好 😀')\n</tool_response>" in rendered
    assert rendered.count('"name":"read_file"') == 1  # the tools block, once, at the head


# -- 4. output limits and tool options ----------------------------------------------------


async def test_max_output_tokens_parallel_tool_calls_and_tool_choice_none(runtime):
    two_calls = (
        tool_call_text("shell", {"cmd": "ls"}) + "\n" + tool_call_text("shell", {"cmd": "pwd"})
    )
    long_text = "one two three four five six seven eight"
    engine = scripted_texts(runtime, [long_text, two_calls, two_calls, two_calls])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        cut = await client.responses.create(model=MODEL, input="Count.", max_output_tokens=3)
        assert engine.requests[-1].sampling.max_tokens == 3
        assert cut.status == "incomplete"
        assert cut.incomplete_details.reason == "max_output_tokens"
        assert cut.usage.output_tokens == 3
        valid_response(cut)
        assert cut.output_text == runtime.tokenizer.decode(runtime.builder.encode(long_text)[:3])

        both = await client.responses.create(model=MODEL, input="Look.", tools=TOOLS)
        calls = [item for item in both.output if item.type == "function_call"]
        assert [json.loads(c.arguments) for c in calls] == [{"cmd": "ls"}, {"cmd": "pwd"}]
        assert len({c.call_id for c in calls}) == 2

        one = await client.responses.create(
            model=MODEL, input="Look.", tools=TOOLS, parallel_tool_calls=False
        )
        assert one.parallel_tool_calls is False
        assert [(i.type, json.loads(i.arguments)) for i in one.output] == [
            ("function_call", {"cmd": "ls"})
        ]

        text = await client.responses.create(
            model=MODEL, input="Look.", tools=TOOLS, tool_choice="none"
        )
        assert [item.type for item in text.output] == ["message"]
        assert text.output_text == two_calls


# -- 5. stored responses ------------------------------------------------------------------


async def test_get_and_delete_stored_responses(runtime):
    engine = scripted_texts(runtime, ["Stored.", "Unused."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        stored = await client.responses.create(model=MODEL, input="Keep this.")
        assert (await client.responses.retrieve(stored.id)).output_text == "Stored."

        unstored = await client.responses.create(model=MODEL, input="Forget.", store=False)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(unstored.id)
        assert missing.value.code == "response_not_found"

        await client.responses.delete(stored.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(stored.id)
        assert gone.value.status_code == 404 and gone.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(stored.id)
        with pytest.raises(openai.BadRequestError) as chained:
            await client.responses.create(
                model=MODEL, input="And then?", previous_response_id=stored.id
            )
        assert chained.value.code == "previous_response_not_found"
        assert chained.value.param == "previous_response_id"
        assert len(engine.requests) == 2  # the failed continuation never reached the engine


# -- 6. tenants: keys, isolation, rate limits ---------------------------------------------

KEYS = """
[[keys]]
key = "sk-alpha-0123456789"
tenant = "alpha"

[[keys]]
key = "sk-beta-0123456789"
tenant = "beta"
requests_per_minute = 2
"""


async def test_tenants_are_authenticated_isolated_and_rate_limited(runtime, tmp_path):
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    config = replace(CONFIG, api_keys_file=str(keys_file))
    engine = scripted_texts(runtime, ["Alpha's secret plan.", "Beta's answer.", "Alpha again."])
    async with serve_gateway(runtime, engine, config) as (url, _):
        alpha = client_for(url, "sk-alpha-0123456789")
        beta = client_for(url, "sk-beta-0123456789")
        for bad_key in ("sk-wrong-0123456789", "sk-alpha-0123456789x"):
            async with client_for(url, bad_key) as intruder:
                with pytest.raises(openai.AuthenticationError) as denied:
                    await intruder.responses.create(model=MODEL, input="hi")
                assert denied.value.status_code == 401
                assert denied.value.code == "invalid_api_key"
        async with httpx.AsyncClient(base_url=url) as raw:
            no_header = await raw.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert no_header.status_code == 401
        assert no_header.json()["error"]["code"] == "invalid_api_key"

        secret = await alpha.responses.create(model=MODEL, input="Plan?")
        with pytest.raises(openai.BadRequestError) as foreign:
            await beta.responses.create(model=MODEL, input="Go on.", previous_response_id=secret.id)
        assert foreign.value.code == "previous_response_not_found"
        assert "secret" not in str(foreign.value.body)
        with pytest.raises(openai.NotFoundError) as hidden:
            await beta.responses.retrieve(secret.id)
        assert "secret" not in str(hidden.value.body)
        with pytest.raises(openai.NotFoundError):
            await beta.responses.delete(secret.id)
        assert (await alpha.responses.retrieve(secret.id)).output_text == "Alpha's secret plan."

        # beta's limit is 2 requests a minute: the refused continuation was the first.
        assert (await beta.responses.create(model=MODEL, input="Hi.")).output_text == (
            "Beta's answer."
        )
        with pytest.raises(openai.RateLimitError) as limited:
            await beta.responses.create(model=MODEL, input="Hi again.")
        assert limited.value.status_code == 429
        assert limited.value.code == "rate_limit_exceeded"
        assert int(limited.value.response.headers["retry-after"]) >= 1
        # The limit is beta's alone.
        assert (await alpha.responses.create(model=MODEL, input="More.")).output_text == (
            "Alpha again."
        )
        await alpha.close()
        await beta.close()
    assert [r.cache_salt for r in engine.requests] == ["alpha", "beta", "alpha"]


# -- 7. bad inputs ------------------------------------------------------------------------


def png_bytes() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), (255, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_message(data: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": url, "detail": "auto"},
    ]
    return [{"type": "message", "role": "user", "content": content}]


ASSISTANT_PART_INT = {"role": "assistant", "content": [{"type": "output_text", "text": 5}]}
# id: (create kwargs over {"model": MODEL, "input": "hi"}, the param the error names)
SDK_BAD_INPUTS = {
    "temperature-str": ({"temperature": "hot"}, "temperature"),
    "input-int": ({"input": 5}, "input"),
    "content-int": ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    "call-output-int": (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]},
        "input[0].output",
    ),
    "unknown-item": ({"input": [{"type": "telepathy"}]}, "input[0].type"),
    "item-missing-field": ({"input": [{"type": "custom_tool_call_output"}]}, "input[0].call_id"),
    "assistant-part-int": ({"input": [ASSISTANT_PART_INT]}, "input[0].content[0]"),
    "generate-over-http": ({"extra_body": {"generate": False}}, "generate"),
    "background": ({"background": True}, "background"),
    "json-format": ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    "max-output-tokens-zero": ({"max_output_tokens": 0}, "max_output_tokens"),
    "unknown-model": ({"model": "gpt-nonexistent"}, "model"),
    "unknown-tool": ({"tools": [{"type": "teleporter"}]}, "tools[0].type"),
    "tool-choice-required": ({"tool_choice": "required"}, "tool_choice"),
    "temperature-range": ({"temperature": 3}, "temperature"),
    "empty-input": ({"input": []}, "input"),
    "broken-image": ({"input": image_message(b"\x89PNG not really")}, "input[0].content[1]"),
    "image-for-text-model": ({"input": image_message(png_bytes())}, "input[0].content[1]"),
}
MESSAGE_WORDS = {
    "generate-over-http": "WebSocket",
    "broken-image": "cannot be decoded",
    "image-for-text-model": "text only",
}


@pytest.mark.parametrize("case", list(SDK_BAD_INPUTS))
async def test_bad_input_gets_its_error_and_the_server_keeps_serving(runtime, case):
    kwargs, param = SDK_BAD_INPUTS[case]
    engine = scripted_texts(runtime, ["Still here."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(**{"model": MODEL, "input": "hi", **kwargs})
        error = refused.value
        if case == "unknown-model":
            assert (error.status_code, error.code) == (404, "model_not_found")
        else:
            assert (error.status_code, error.code) == (400, "invalid_request")
        assert error.param == param
        assert MESSAGE_WORDS.get(case, "") in error.message
        assert engine.requests == []
        assert (await client.responses.create(model=MODEL, input="ok?")).output_text == (
            "Still here."
        )


async def test_malformed_bodies_get_clear_errors(runtime):
    config = replace(CONFIG, max_body_bytes=4096)
    engine = scripted_texts(runtime, ["Fine.", "Still fine."])
    async with serve_gateway(runtime, engine, config) as (url, _), client_for(url) as client:
        async with httpx.AsyncClient(base_url=url, timeout=10) as raw:
            headers = {"content-type": "application/json"}

            async def post(content) -> httpx.Response:
                return await raw.post("/v1/responses", content=content, headers=headers)

            broken = await post(b'{"model": "' + MODEL.encode() + b'", "input": ')
            assert broken.status_code == 400
            assert broken.json()["error"]["code"] == "invalid_json"

            latin1 = await post(b'{"model": "m", "input": "caf\xe9"}')
            assert latin1.status_code == 400
            assert "UTF-8" in latin1.json()["error"]["message"]

            not_object = await post(b"[1, 2, 3]")
            assert not_object.status_code == 400

            missing_model = await post(b'{"input": "hi"}')
            assert missing_model.status_code == 400
            assert missing_model.json()["error"]["param"] == "model"

            async def chunks():
                for _ in range(10):
                    yield b" " * 1024  # no content-length: the server counts as it reads

            for method, path, status, code in [
                ("GET", "/v1/nowhere", 404, "not_found"),
                ("PUT", "/v1/responses", 405, "method_not_allowed"),
            ]:
                routed = await raw.request(method, path)
                assert routed.status_code == status
                assert routed.json()["error"]["code"] == code

            chunked = await post(chunks())
            assert chunked.status_code == 413
            assert chunked.json()["error"]["code"] == "payload_too_large"

        with pytest.raises(openai.APIStatusError) as too_big:
            await client.responses.create(model=MODEL, input="x" * 5000)
        assert too_big.value.status_code == 413
        assert too_big.value.code == "payload_too_large"

        ignored = await client.responses.create(
            model=MODEL, input="hi", extra_body={"frobnicate": {"level": 11}, "seed": 3}
        )
        assert ignored.status == "completed" and ignored.output_text == "Fine."
        assert (await client.responses.create(model=MODEL, input="ok?")).output_text == (
            "Still fine."
        )
    assert len(engine.requests) == 2


# -- 8. models, health, metrics -----------------------------------------------------------


async def test_models_health_metrics_and_load_header(runtime):
    engine = scripted_texts(runtime, ["Measured."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        models = await client.models.list()
        assert [model.id for model in models.data] == [MODEL]

        raw_response = await client.responses.with_raw_response.create(model=MODEL, input="hi")
        load = raw_response.headers["endpoint-load-metrics"]
        assert load.startswith("TEXT ") and "cpu_utilization=" in load
        assert raw_response.parse().output_text == "Measured."

        async with httpx.AsyncClient(base_url=url, timeout=10) as raw:
            health = await raw.get("/healthz")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            exposition = (await raw.get("/metrics")).text

    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }
    names = {name for name, _ in samples}
    for name in (
        "once_gateway_requests_total",
        "once_gateway_tokenized_tokens_total",
        "once_gateway_prompt_tokens_total",
        "once_gateway_renders_total",
        "once_gateway_cpu_info",
    ):
        assert name in names, name
    completed = (("outcome", "response.completed"), ("transport", "http"))
    assert samples[("once_gateway_requests_total", completed)] == 1
    prompt_tokens = len(engine.requests[0].prompt_token_ids)
    assert samples[("once_gateway_prompt_tokens_total", ())] == prompt_tokens
    assert samples[("once_gateway_tokenized_tokens_total", ())] == prompt_tokens


# -- a client that goes away ---------------------------------------------------------------


async def test_client_leaving_mid_stream_aborts_the_engine_request(runtime):
    slow_text = "one two three four five six seven eight nine ten eleven twelve"
    engine = scripted_texts(runtime, [slow_text, "Next."], token_latency_s=0.05)
    async with serve_gateway(runtime, engine) as (url, gateway), client_for(url) as client:
        stream = await client.responses.create(model=MODEL, input="Count.", stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        request_id = engine.requests[0].request_id
        async with asyncio.timeout(5):
            while engine.finish_reasons.get(request_id) != "abort":
                await asyncio.sleep(0.01)
        assert (await client.responses.create(model=MODEL, input="Hi.")).output_text == "Next."
        assert metric(gateway, "requests", "http", "disconnected") == 1
        assert gateway.metrics.inflight._value.get() == 0
