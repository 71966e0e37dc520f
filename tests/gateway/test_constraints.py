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

from once.engine.grammar import grammar_source
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


PATCH_GRAMMAR = """start: begin hunk+ end
begin: "*** Begin Patch" LF
end: "*** End Patch" LF?
hunk: "*** Add File: " /(.+)/ LF ("+" /(.*)/ LF)+
%import common.LF
"""
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
TICKET = {
    "type": "custom",
    "name": "ticket",
    "format": {"type": "grammar", "syntax": "regex", "definition": "^[A-Z]{3}-[0-9]+$"},
}
NOTE = {"type": "custom", "name": "note"}


@pytest.fixture(scope="module")
def grammar_tokenizer(runtime):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(runtime.tokenizer)


def matches(tokenizer, constraint, text: str) -> bool:
    """Whether the engine's matcher takes `text` whole under the constraint."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar_source(constraint), log_level=0)
    ids = tokenizer.tokenize_str(text)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def call(name: str, **payload) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, **payload})}\n</tool_call>"


def raw_call(name: str, text: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name})}\n{text}\n</tool_call>"


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


async def constraints_of(runtime, tools, choices, **extra) -> list:
    engine = scripted_texts(runtime, ["ok"] * len(choices))
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        for choice in choices:
            await client.responses.create(
                model=MODEL, input="x", tools=tools, tool_choice=choice, **extra
            )
    return [request.sampling.constraint for request in engine.requests]


async def test_required_and_named_choices_constrain_the_output_to_one_call(
    runtime, grammar_tokenizer
):
    required, named = await constraints_of(
        runtime, [TOOL, LOOSE], ["required", {"type": "function", "name": "lookup"}]
    )
    ok = call("lookup", arguments={"word": "cat"})
    loose = call("browse", arguments={"anything": [1, 2]})
    assert matches(grammar_tokenizer, required, ok)
    assert matches(grammar_tokenizer, required, loose)  # a loose function: any object
    assert not matches(grammar_tokenizer, required, call("lookup", arguments={"word": 3}))
    assert not matches(grammar_tokenizer, required, call("other", arguments={}))
    assert not matches(grammar_tokenizer, required, "No call. " + ok)  # nothing but the call
    assert matches(grammar_tokenizer, named, ok)
    assert not matches(grammar_tokenizer, named, loose)


async def test_a_custom_tools_grammar_is_its_input_and_a_free_one_takes_any_text(
    runtime, grammar_tokenizer
):
    patch, ticket, note = await constraints_of(
        runtime,
        [PATCH, TICKET, NOTE],
        [{"type": "custom", "name": n} for n in ("apply_patch", "ticket", "note")],
    )
    good = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n"
    assert matches(grammar_tokenizer, patch, raw_call("apply_patch", good))
    assert not matches(grammar_tokenizer, patch, raw_call("apply_patch", "hello"))
    assert not matches(grammar_tokenizer, patch, call("apply_patch", input=good))  # JSON form
    assert matches(grammar_tokenizer, ticket, raw_call("ticket", "ABC-123"))
    assert not matches(grammar_tokenizer, ticket, raw_call("ticket", "AB-123"))
    assert matches(grammar_tokenizer, note, raw_call("note", 'any "text"\nat all'))


async def test_in_auto_mode_text_is_free_and_calls_of_enforced_tools_follow_their_grammar(
    runtime, grammar_tokenizer
):
    (auto,) = await constraints_of(runtime, [TOOL, LOOSE, TICKET], ["auto"])
    assert matches(grammar_tokenizer, auto, "Just text, with <b>tags</b> and { braces.")
    two_calls = "Filing.\n" + raw_call("ticket", "ABC-1") + "\n" + call("browse", arguments={})
    assert matches(grammar_tokenizer, auto, two_calls)
    assert not matches(grammar_tokenizer, auto, "Filing.\n" + raw_call("ticket", "abc"))
    assert not matches(grammar_tokenizer, auto, call("lookup", arguments={"word": 3}))
    assert not matches(grammar_tokenizer, auto, call("nope", arguments={}))
    (single,) = await constraints_of(runtime, [TICKET], ["auto"], parallel_tool_calls=False)
    assert not matches(grammar_tokenizer, single, raw_call("ticket", "A-1") * 2)
    # Nothing to enforce (loose functions only), or no call allowed: no constraint.
    assert await constraints_of(runtime, [LOOSE], ["auto"]) == [None]
    assert await constraints_of(runtime, [TOOL, TICKET], ["none"]) == [None]


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


async def test_a_custom_tool_grammar_that_does_not_compile_is_refused_by_name(runtime):
    broken = {**PATCH, "format": {**PATCH["format"], "definition": "start: undefined_rule"}}
    namespace = {"type": "namespace", "name": "ns", "description": "d", "tools": [TICKET, broken]}
    engine = scripted_texts(runtime, [])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        for tools, param in (([NOTE, broken], "tools[1]"), ([namespace], "tools[0].tools[1]")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=MODEL, input="x", tools=tools)
            assert refused.value.param == f"{param}.format.definition"
            assert "undefined_rule" in refused.value.message
    assert engine.requests == []
