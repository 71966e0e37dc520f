"""Bad input gets a 4xx naming its param, over HTTP and over WebSocket, never a 500.

Each case is a body the SDK's types would coerce or a parser would choke on: a string
where a number belongs, a lone UTF-16 surrogate, JSON nested 100,000 deep, an output item
without its `call_id`, a prompt far past the context. The server keeps serving after each.
"""

import json

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

CASES = {
    "max-output-tokens-str": ({"max_output_tokens": "5"}, "max_output_tokens"),
    "temperature-str": ({"temperature": "0.5"}, "temperature"),
    "top-p-str": ({"top_p": "1"}, "top_p"),
    "store-str": ({"store": "false"}, "store"),
    "store-int": ({"store": 0}, "store"),
    "parallel-str": ({"parallel_tool_calls": "false"}, "parallel_tool_calls"),
    "max-output-tokens-bool": ({"max_output_tokens": True}, "max_output_tokens"),
    "output-without-call-id": (
        {"input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id",
    ),
}


def raw_body(**fields) -> str:
    return json.dumps({"model": MODEL, "input": "hi", **fields})


@pytest.mark.parametrize("case", list(CASES))
async def test_no_coercion_each_refusal_names_its_param(runtime, case):
    fields, param = CASES[case]
    engine = scripted_texts(runtime, ["fine"])
    async with serve_gateway(runtime, engine) as (url, _):
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=10) as http:
            refused = await http.post("/responses", content=raw_body(**fields))
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param
            assert (await http.post("/responses", content=raw_body())).status_code == 200
    assert len(engine.requests) == 1


async def test_surrogates_nesting_and_huge_prompts_are_4xx_and_cheap(runtime):
    engine = scripted_texts(runtime, ["fine", "fine"])
    calls = []
    full = runtime.builder.full

    def counting_full(*args):
        calls.append(len(args[-1]))
        return full(*args)

    runtime.builder.full = counting_full
    try:
        async with serve_gateway(runtime, engine) as (url, _):
            async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=30) as http:
                lone = json.dumps({"model": MODEL, "input": "x"}).replace('"x"', '"\\ud800"')
                assert (await http.post("/responses", content=lone)).status_code == 400
                emoji = json.dumps({"model": MODEL, "input": "\U0001f600"}, ensure_ascii=True)
                assert (await http.post("/responses", content=emoji)).status_code == 200
                nested = "[" * 100_000 + "]" * 100_000
                deep = raw_body()[:-1] + f', "metadata": {nested}}}'
                refused = await http.post("/responses", content=deep)
                assert refused.status_code == 400 and "nests deeper" in refused.text
                huge = raw_body(input="word " * 4_000_000)  # 20 MB
                tokens_before = len(calls)
                too_long = await http.post("/responses", content=huge)
                assert too_long.status_code == 400
                assert too_long.json()["error"]["code"] == "context_length_exceeded"
                assert len(calls) == tokens_before  # refused before any render
                assert (await http.post("/responses", content=raw_body())).status_code == 200
    finally:
        del runtime.builder.full


async def test_every_websocket_request_gets_an_answer_whatever_it_holds(runtime):
    engine = scripted_texts(runtime, ["fine"])
    frames = [
        {"type": "response.create", "model": MODEL, "input": "hi", "temperature": "0.5"},
        {"type": "response.create", "model": MODEL, "input": "\ud800"},
        {"type": "response.create", "model": MODEL, "input": [{"type": "function_call_output"}]},
    ]
    async with serve_gateway(runtime, engine) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        async with client.responses.connect() as connection:
            for frame in frames:
                text = json.dumps(frame, ensure_ascii=True)
                await connection._connection.send(text)  # raw text: the SDK would validate
                answer = await connection.recv()
                assert answer.type == "error", answer
            await connection.response.create(model=MODEL, input="ok?")
            async for event in connection:
                if event.type == "response.completed":
                    break
        await client.close()
