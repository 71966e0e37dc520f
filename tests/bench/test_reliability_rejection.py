"""A 20 MB prompt is refused as too long at every door, and nothing tokenizes it.

The gateway runs in this process (so the tokenizer's calls can be counted) on the
rejection benchmark's own bodies; a small request afterwards must tokenize, which shows
the count is live.
"""

import json

import httpx
import pytest
import websockets

from once.bench.reliability.rejection import (
    CODE,
    DOORS,
    case_body,
    error_code,
    prompt_text,
)
from once.gateway.testing import load_runtime, scripted_texts, serve_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime():
    return load_runtime()


@pytest.fixture
def tokenizer_calls(runtime):
    """Counts PromptBuilder.encode, the one place tokens.py tokenizes a prompt."""
    calls: list[int] = []
    encode = runtime.builder.encode

    def counting_encode(text):
        calls.append(len(text))
        return encode(text)

    runtime.builder.encode = counting_encode
    yield calls
    del runtime.builder.encode


async def refuse(url: str, http: httpx.AsyncClient, door: str, body: bytes) -> tuple[int, dict]:
    if door == "responses_ws":
        ws_url = url.replace("http://", "ws://") + DOORS[door]
        async with websockets.connect(ws_url, compression=None, max_size=None) as socket:
            await socket.send(b'{"type":"response.create",' + body[1:], text=True)
            reply = json.loads(await socket.recv())
            return reply["status"], reply
    response = await http.post(DOORS[door], content=body)
    return response.status_code, response.json()


async def test_a_20_mb_prompt_is_refused_everywhere_without_tokenizing(runtime, tokenizer_calls):
    engine = scripted_texts(runtime, ["fine"])
    text = prompt_text(20_000_000)
    async with serve_gateway(runtime, engine) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            for door in DOORS:
                body = json.dumps(case_body(door, text)).encode()
                assert len(body) > 20_000_000
                status, reply = await refuse(url, http, door, body)
                assert status == 400, (door, reply)
                assert error_code(door, status, reply) == CODE, (door, reply)
            # Nothing near the prompt's size was tokenized (a few-character text is).
            assert max(tokenizer_calls, default=0) < 1000
            assert engine.requests == []
            num_before = len(tokenizer_calls)
            small = {"model": runtime.name, "input": "hi"}
            assert (await http.post("/v1/responses", json=small)).status_code == 200
    assert len(tokenizer_calls) > num_before  # the count sees a prompt that is tokenized


async def test_the_token_counters_still_count_a_prompt_that_fits(runtime):
    async with serve_gateway(runtime, scripted_texts(runtime, [])) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            counted = await http.post(
                "/v1/responses/input_tokens", json=case_body("responses_input_tokens", "hello")
            )
            assert counted.status_code == 200
            assert counted.json()["input_tokens"] > 1
            messages = await http.post(
                "/v1/messages/count_tokens", json=case_body("messages_count_tokens", "hello")
            )
            assert messages.status_code == 200
            assert messages.json()["input_tokens"] > 1
