"""Chat Completions on the gateway, with the official `openai` SDK as the client.

The reference for rendering is the Responses API on the same gateway: a conversation sent
as chat messages must reach the engine as exactly the token ids of the same conversation
sent as Responses items (`engine.requests[i].prompt_token_ids`). Objects and chunks are
validated with the SDK's own models.
"""

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
RESPONSES_TOOLS = [
    {"type": "function", "strict": False, **tool["function"]} for tool in TOOLS
]  # the same tools as the Responses API takes them
CALL = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)


async def test_a_completion_is_an_sdk_object_with_the_engine_usage(runtime):
    engine = scripted_texts(runtime, ["Hello!", "Again."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        first = await client.chat.completions.create(model=MODEL, messages=messages)
        ChatCompletion.model_validate(first.model_dump())
        assert first.object == "chat.completion" and first.model == MODEL
        choice = first.choices[0]
        assert (choice.message.role, choice.message.content) == ("assistant", "Hello!")
        assert choice.finish_reason == "stop"
        prompt = engine.requests[0].prompt_token_ids
        assert first.usage.prompt_tokens == len(prompt)
        assert first.usage.completion_tokens == len(runtime.builder.encode("Hello!")) + 1
        assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = await client.chat.completions.create(model=MODEL, messages=messages)
        # The engine's prefix cache held the same prompt: the cached count comes from it.
        assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_messages_render_as_the_same_conversation_through_the_responses_api(runtime):
    texts = [CALL, "There are two files."]
    engine = scripted_texts(runtime, texts + texts)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is here?"},
        ]
        first = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == ("shell", {"cmd": "ls"})
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "a.py b.py"},
        ]
        second = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == texts[1]

        # The reference: the same two turns as Responses items.
        items = [{"type": "message", "role": "user", "content": "What is here?"}]
        reply = await client.responses.create(
            model=MODEL, instructions="You are terse.", input=items, tools=RESPONSES_TOOLS,
            store=False,
        )  # fmt: skip
        items += [o.model_dump(exclude_none=True) for o in reply.output]
        items.append(
            {"type": "function_call_output", "call_id": reply.output[0].call_id,
             "output": "a.py b.py"}
        )  # fmt: skip
        await client.responses.create(
            model=MODEL, instructions="You are terse.", input=items, tools=RESPONSES_TOOLS,
            store=False,
        )  # fmt: skip
    prompts = [list(r.prompt_token_ids) for r in engine.requests]
    assert prompts[0] == prompts[2] and prompts[1] == prompts[3]


async def test_a_stream_of_sdk_chunks_ends_with_usage_and_done(runtime):
    text = "Café ☕ is ready, with a tool call next."
    engine = scripted_texts(runtime, [text + "\n" + CALL])
    async with serve_gateway(runtime, engine) as (url, _):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Go"}],
            "tools": TOOLS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                lines = [line async for line in response.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in lines[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "shell")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


async def test_the_sdk_stream_helper_accumulates_the_completion(runtime):
    engine = scripted_texts(runtime, ["Streamed answer."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        messages = [{"role": "user", "content": "Stream it"}]
        async with client.chat.completions.stream(model=MODEL, messages=messages) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
    assert final.choices[0].message.content == "Streamed answer."


async def test_a_stop_string_cuts_the_text_and_the_engine_request(runtime):
    text = "one two three STOP four five six seven eight nine ten"
    engine = scripted_texts(runtime, [text], token_latency_s=0.02)
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], stop=["STOP", "zzz"]
        )
        assert completion.choices[0].message.content == "one two three "
        assert completion.choices[0].finish_reason == "stop"
        request_id = engine.requests[0].request_id
        async with asyncio.timeout(5):
            while engine.finish_reasons.get(request_id) != "abort":
                await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"n": 2}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"temperature": "0.5"}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": []}, "messages"),
        ({"model": "gpt-9"}, "model"),
        ({"response_format": {"type": "json_object"}}, "messages"),  # OpenAI's "json" rule
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
async def test_a_refused_request_names_its_param_and_the_server_keeps_serving(
    runtime, change, param
):
    engine = scripted_texts(runtime, ["Still here."])
    async with serve_gateway(runtime, engine) as (url, _):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **change}
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            refused = await http.post("/v1/chat/completions", json=body)
            assert refused.status_code in (400, 404), refused.text
            assert refused.json()["error"]["param"] == param
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            ok = await http.post("/v1/chat/completions", json=body)
    assert ok.json()["choices"][0]["message"]["content"] == "Still here."
    assert len(engine.requests) == 1


async def test_logprobs_come_from_the_engine_token_by_token(runtime):
    text = "Yes, it works."
    engine = scripted_texts(runtime, [text, text])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        messages = [{"role": "user", "content": "Does it?"}]
        completion = await client.chat.completions.create(
            model=MODEL, messages=messages, logprobs=True, top_logprobs=2
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, logprobs=True, stream=True
        )
        streamed = [c.choices[0].logprobs for c in [chunk async for chunk in stream] if c.choices]
    assert engine.requests[0].sampling.logprobs == 2 and engine.requests[1].sampling.logprobs == 0
    content = completion.choices[0].logprobs.content
    ids = runtime.builder.encode(text)
    # The scripted engine's logprobs (protocol/scripted_engine.py): 0.0 for its own id, -i
    # for id + i.
    decode = runtime.tokenizer.backend_tokenizer.decode
    assert [entry.token for entry in content][: len(ids)] == [decode([i]) for i in ids]
    assert all(entry.logprob == 0.0 and len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].top_logprobs[1].logprob == -1.0
    tokens = [e.token for lp in streamed if lp is not None for e in lp.content]
    assert "".join(tokens).startswith(text)
