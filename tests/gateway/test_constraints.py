"""Structured outputs and forced calls reach the engine as a grammar constraint.

The scripted engine records each request's `SamplingParams.constraint`: these tests check
what the gateway asks the engine to enforce, from each API's own way of asking; that the
engine enforces it is the engine's tests' business (tests/engine/test_grammar*.py), and
the SDK's structured-output helpers parse what comes back.
"""

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from once.gateway.constraints import CALL_GRAMMAR
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    "strict": True,
}
LOOSE = {**TOOL, "name": "browse", "strict": False}


class Answer(BaseModel):
    city: str
    population: int


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)


def call_schema(constraint) -> dict:
    assert constraint.kind == "lark" and constraint.text.startswith(CALL_GRAMMAR)
    return json.loads(constraint.text[len(CALL_GRAMMAR) :])


async def test_the_sdk_parse_helper_gets_json_its_schema_constrained(runtime):
    engine = scripted_texts(runtime, ['{"city": "Paris", "population": 2100000}'])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        parsed = await client.responses.parse(
            model=MODEL, input="Largest city of France?", text_format=Answer
        )
    assert parsed.output_parsed == Answer(city="Paris", population=2100000)
    constraint = engine.requests[0].sampling.constraint
    assert constraint.kind == "json_schema"
    assert json.loads(constraint.text)["required"] == ["city", "population"]
    assert parsed.text.format.type == "json_schema"  # the format is echoed


async def test_required_and_named_choices_constrain_the_output_to_a_call(runtime):
    engine = scripted_texts(
        runtime, ['<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'] * 3
    )
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        for choice in ("required", {"type": "function", "name": "lookup"}):
            await client.responses.create(
                model=MODEL, input="define cat", tools=[TOOL, LOOSE], tool_choice=choice
            )
    required, named = (call_schema(r.sampling.constraint) for r in engine.requests)
    names = [branch["properties"]["name"]["const"] for branch in required["anyOf"]]
    assert names == ["browse", "lookup"]
    # A strict function's arguments follow its schema; a loose one's are any object.
    by_name = {b["properties"]["name"]["const"]: b for b in required["anyOf"]}
    assert by_name["lookup"]["properties"]["arguments"] == TOOL["parameters"]
    assert by_name["browse"]["properties"]["arguments"] == {"type": "object"}
    assert named["properties"]["name"] == {"const": "lookup"}
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        await client.responses.create(model=MODEL, input="x", tools=[TOOL], tool_choice="auto")
    assert engine.requests[-1].sampling.constraint is None


async def test_chat_response_format_and_messages_output_config_are_json_constraints(runtime):
    engine = scripted_texts(runtime, ['{"city": "Rome", "population": 1}'] * 3)
    schema = Answer.model_json_schema()
    async with serve_gateway(runtime, engine) as (url, _):
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=10) as http:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "city?"}]}
            fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
            assert (
                await http.post("/chat/completions", json={**chat, "response_format": fmt})
            ).status_code == 200
            json_object = {"type": "json_object"}
            refused = await http.post(
                "/chat/completions", json={**chat, "response_format": json_object}
            )
            assert refused.json()["error"]["param"] == "messages"  # no "json" in the input
            messages = {
                "model": MODEL,
                "max_tokens": 32,
                "messages": [{"role": "user", "content": "city?"}],
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            }
            assert (await http.post("/messages", json=messages)).status_code == 200
    for request in engine.requests:
        constraint = request.sampling.constraint
        assert constraint.kind == "json_schema" and json.loads(constraint.text) == schema


@pytest.mark.parametrize(
    "choice, param_word",
    [
        ({"type": "function", "name": "nope"}, "nope"),
        ({"type": "web_search_preview"}, "hosted"),
    ],
)
async def test_a_choice_that_cannot_be_honoured_is_refused(runtime, choice, param_word):
    engine = scripted_texts(runtime, [])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input="x", tools=[TOOL], tool_choice=choice)
    assert refused.value.param == "tool_choice" and param_word in refused.value.message
    assert engine.requests == []
