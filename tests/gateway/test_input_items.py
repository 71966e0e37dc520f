"""`GET /v1/responses/{id}/input_items` through the official SDK's paginator and types."""

import httpx
import openai
import pytest
from openai.types.responses import ResponseItemList

from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway
from tests.gateway.test_http import TOOLS, client_for, tool_call_text, tool_outputs, user


def _shape(item) -> tuple:
    """(type, role or name, text or arguments/output) of one listed item."""
    data = item.to_dict()
    if data["type"] == "message":
        return ("message", data["role"], "".join(p["text"] for p in data["content"]))
    if data["type"] == "function_call":
        return ("function_call", data["name"], data["arguments"])
    return (data["type"], data.get("call_id"), data.get("output"))


async def _chain(client):
    """Three turns: a question, a tool call answered by its output, a final message."""
    first = await client.responses.create(
        model=MODEL, instructions="Be brief.", tools=TOOLS, input="List the files."
    )
    second = await client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=tool_outputs(first, ["a.py b.py"]),
    )
    third = await client.responses.create(
        model=MODEL, previous_response_id=second.id, input=[user("Thanks. Which is bigger?")]
    )
    return first, second, third


async def test_a_chained_response_lists_the_whole_chain_oldest_first(runtime):
    texts = [tool_call_text("shell", {"cmd": "ls"}), "Two files.", "b.py."]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        first, second, third = await _chain(client)
        listed = [item async for item in client.responses.input_items.list(third.id, order="asc")]
        call = first.output[0]
        assert [_shape(item) for item in listed] == [
            ("message", "user", "List the files."),
            ("function_call", "shell", call.arguments),
            ("function_call_output", call.call_id, "a.py b.py"),
            ("message", "assistant", "Two files."),
            ("message", "user", "Thanks. Which is bigger?"),
        ]
        # Earlier turns' outputs keep the ids the client saw in those responses.
        assert listed[1].id == first.output[0].id and listed[3].id == second.output[0].id
        # The first response's own list holds only its own input.
        own = [item async for item in client.responses.input_items.list(first.id)]
        assert [_shape(item) for item in own] == [("message", "user", "List the files.")]

        # Raw body: validates as the SDK's list type; default order is newest first.
        async with httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer k"}) as raw:
            body = (await raw.get(f"/v1/responses/{third.id}/input_items")).json()
        ResponseItemList.model_validate(body)
        assert [item["id"] for item in body["data"]] == [item.id for item in reversed(listed)]
        assert body["has_more"] is False


async def test_pages_walk_the_list_with_after_in_both_orders(runtime):
    texts = [tool_call_text("shell", {"cmd": "ls"}), "Two files.", "b.py."]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        *_, third = await _chain(client)
        everything = [item.id async for item in client.responses.input_items.list(third.id)]
        assert len(everything) == 5 and len(set(everything)) == 5
        for order, expected in (("desc", everything), ("asc", everything[::-1])):
            first_page = await client.responses.input_items.list(third.id, limit=2, order=order)
            assert [i.id for i in first_page.data] == expected[:2] and first_page.has_more
            # The SDK's auto-pagination follows `after` = the last id of each page.
            walked = [
                i.id
                async for i in client.responses.input_items.list(third.id, limit=2, order=order)
            ]
            assert walked == expected
        last = await client.responses.input_items.list(third.id, limit=2, after=everything[2])
        assert [i.id for i in last.data] == everything[3:] and not last.has_more


@pytest.mark.parametrize(
    "query, param",
    [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
     ("order=up", "order"), ("after=item_nope", "after")],
)  # fmt: skip
async def test_bad_paging_parameters_get_400_naming_the_param(runtime, query, param):
    engine = scripted_texts(runtime, ["Fine."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        stored = await client.responses.create(model=MODEL, input="Hello.")
        async with httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer k"}) as raw:
            reply = await raw.get(f"/v1/responses/{stored.id}/input_items?{query}")
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param
            still = await raw.get(f"/v1/responses/{stored.id}/input_items")
            assert still.status_code == 200 and len(still.json()["data"]) == 1


async def test_missing_unstored_and_deleted_responses_are_not_found(runtime):
    engine = scripted_texts(runtime, ["One.", "Two.", "Three."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        unstored = await client.responses.create(model=MODEL, input="Forget.", store=False)
        stored = await client.responses.create(model=MODEL, input="Keep.")
        later = await client.responses.create(
            model=MODEL, previous_response_id=stored.id, input=[user("More.")]
        )
        for missing in ("resp_nope", unstored.id):
            with pytest.raises(openai.NotFoundError) as error:
                await client.responses.input_items.list(missing)
            assert error.value.code == "response_not_found"
        # A deleted ancestor drops out of its descendants' lists; nothing else changes.
        await client.responses.delete(stored.id)
        left = [item async for item in client.responses.input_items.list(later.id)]
        assert [_shape(item) for item in left] == [("message", "user", "More.")]
