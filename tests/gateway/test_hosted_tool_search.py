"""Server-side `tool_search`: the gateway runs the model's search inside the response.

The scripted model searches, then calls what it found; the ranker is the harness's own
(once.tool_search), as `once serve` runs it. The response must hold the search
call, its output and the client's call, in order, as SDK types; the deferred tools never
reach the prompt's head, and the second step's prompt is the first one's extended.
"""

import json

import openai
from openai.types.responses import Response

from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "defer_loading": True,
}
STOCKS = {**WEATHER, "name": "get_stock", "description": "Stock price of a ticker."}
READ = {"type": "function", "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object"}}  # fmt: skip
SEARCH = {"type": "tool_search"}


def block(name: str, **payload) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, **payload}) + "\n</tool_call>"


async def test_a_search_runs_in_the_response_and_the_model_calls_what_it_found(runtime):
    texts = [
        block("tool_search", arguments={"query": "weather city"}),
        block("get_weather", arguments={"city": "Oslo"}),
    ]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine) as (url, gateway):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        response = await client.responses.create(
            model=MODEL, input="Weather in Oslo?", tools=[SEARCH, READ, WEATHER, STOCKS]
        )
        await client.close()
    Response.model_validate(response.to_dict())
    search, found, call = response.output
    assert (search.type, search.execution, search.arguments) == (
        "tool_search_call",
        "server",
        {"query": "weather city"},
    )
    assert found.type == "tool_search_output" and found.call_id == search.call_id
    assert [t.name for t in found.tools][0] == "get_weather"  # the best match first
    assert (call.type, call.name) == ("function_call", "get_weather")
    first, second = (list(r.prompt_token_ids) for r in engine.requests)
    head = runtime.tokenizer.decode(first)
    assert "read_file" in head and "get_weather" not in head  # deferred: not in the head
    assert second[: len(first) - 3] == first[: len(first) - 3]  # extends the first prompt
    assert "get_weather" in runtime.tokenizer.decode(second[len(first) - 3 :])
    used = response.usage
    assert used.input_tokens == len(first) + len(second)


async def test_a_client_search_is_the_clients_to_run(runtime):
    engine = scripted_texts(runtime, [block("tool_search", arguments={"query": "weather"})])
    async with serve_gateway(runtime, engine) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        response = await client.responses.create(
            model=MODEL, input="Weather?", tools=[{"type": "tool_search", "execution": "client"}]
        )
        await client.close()
    assert [item.type for item in response.output] == ["tool_search_call"]
    assert response.output[0].execution == "client" and len(engine.requests) == 1
