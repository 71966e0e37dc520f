"""Every tool kind of the Responses API, through the real gateway and the `openai` SDK.

The model's calls are scripted as the prompt tells it to write them (`<tool_call>` blocks,
tool_items.py); each must come back as its own item type, validated with the SDK's
`Response` model, and go back into the next prompt exactly as a full render writes it.
"""

import httpx
import openai
from openai.types.responses import Response

from once.gateway.prompt.toolcalls import render_tool_call
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

NAMESPACE = {
    "type": "namespace",
    "name": "mcp__time",
    "description": "Tools in the mcp__time namespace.",
    "tools": [
        {
            "type": "function",
            "name": "get_current_time",
            "description": "Current time in a timezone",
            "strict": False,
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        }
    ],
}
CUSTOM = {
    "type": "custom",
    "name": "exec",
    "description": "Run JavaScript.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"},
}
CLIENT_SEARCH = {
    "type": "tool_search",
    "execution": "client",
    "description": "Find tools.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "code_interpreter",
          "container": {"type": "auto"}}]  # fmt: skip


def block(name: str, **payload) -> str:
    ((key, value),) = payload.items()
    return render_tool_call(name, value, key)


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)


def as_input(response) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in response.output]


async def test_a_namespaced_function_is_called_with_its_namespace(runtime):
    engine = scripted_texts(
        runtime, [block("mcp__time.get_current_time", arguments={"timezone": "UTC"}), "Noon."]
    )
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        first = await client.responses.create(model=MODEL, input="time?", tools=[NAMESPACE])
        Response.model_validate(first.to_dict())
        call = first.output[0]
        assert (call.type, call.namespace, call.name) == (
            "function_call",
            "mcp__time",
            "get_current_time",
        )
        prompt = runtime.tokenizer.decode(engine.requests[0].prompt_token_ids)
        assert '"name":"mcp__time","tools":[{"description":"Current time' in prompt
        assert "<namespace>.<tool>" in prompt
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
        second = await client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "time?"}, *as_input(first), output],
            tools=[NAMESPACE],
            store=False,
        )
        assert second.output_text == "Noon."
    history = runtime.tokenizer.decode(engine.requests[1].prompt_token_ids)
    assert '{"name": "mcp__time.get_current_time", "arguments": {"timezone": "UTC"}}' in history


async def test_a_custom_tool_takes_free_form_input_and_streams_its_events(runtime):
    code = 'const r = await tools.exec_command({cmd: "ls"});\ntext(r.output);'
    engine = scripted_texts(runtime, [block("exec", input=code), "Two files."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        stream = await client.responses.create(
            model=MODEL, input="list", tools=[CUSTOM], stream=True
        )
        events = [event async for event in stream]
        kinds = [event.type for event in events]
        assert "response.custom_tool_call_input.delta" in kinds
        done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
        final = events[-1].response
        call = final.output[0]
        assert (call.type, call.name, call.input) == ("custom_tool_call", "exec", code)
        assert done.input == code
        output = {
            "type": "custom_tool_call_output",
            "call_id": call.call_id,
            "output": [{"type": "input_text", "text": "a.py b.py"}],
        }
        second = await client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "list"}, *as_input(final), output],
            tools=[CUSTOM],
            store=False,
        )
        assert second.output_text == "Two files."
    prompt = runtime.tokenizer.decode(engine.requests[1].prompt_token_ids)
    assert '{"name": <tool-name>}\n<the text>' in prompt
    assert '<tool_call>\n{"name": "exec"}\n' + code + "\n</tool_call>" in prompt
    assert "<tool_response>\na.py b.py\n</tool_response>" in prompt


async def test_client_tool_search_and_the_typed_client_tools_make_their_own_items(runtime):
    calls = [
        block("tool_search", arguments={"query": "current time"}),
        block("local_shell", arguments={"command": ["ls", "-la"]}),
        block("shell", arguments={"commands": ["pwd"]}),
        block("apply_patch", arguments={"type": "delete_file", "path": "old.py"}),
    ]
    tools = [CLIENT_SEARCH, {"type": "local_shell"}, {"type": "shell"}, {"type": "apply_patch"}]
    engine = scripted_texts(runtime, ["\n".join(calls)])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        response = await client.responses.create(model=MODEL, input="go", tools=tools)
    Response.model_validate(response.to_dict())
    search, local, shell, patch = response.output
    assert (search.type, search.execution, search.arguments) == (
        "tool_search_call",
        "client",
        {"query": "current time"},
    )
    assert local.type == "local_shell_call" and local.action.command == ["ls", "-la"]
    assert shell.type == "shell_call" and shell.action.commands == ["pwd"]
    assert patch.type == "apply_patch_call" and patch.operation.path == "old.py"


async def test_hosted_tools_are_accepted_left_out_of_the_prompt_and_reported(runtime):
    engine = scripted_texts(runtime, ["No search here.", "No search here."])
    async with serve_gateway(runtime, engine) as (url, _):
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=10) as http:
            body = {"model": MODEL, "input": "news?", "tools": HOSTED}
            reply = await http.post("/responses", json=body)
            plain = await http.post("/responses", json={"model": MODEL, "input": "news?"})
    assert reply.status_code == 200
    assert reply.headers["once-ignored-tools"] == "web_search, code_interpreter"
    assert reply.json()["once_ignored_tools"] == ["web_search", "code_interpreter"]
    assert "once_ignored_tools" not in plain.json()
    # Nothing of them reached the prompt: the same ids as a request without tools.
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids


async def test_tools_given_in_an_additional_tools_item_are_rendered_and_callable(runtime):
    item = {"type": "additional_tools", "role": "developer", "tools": [NAMESPACE]}
    engine = scripted_texts(
        runtime, [block("mcp__time.get_current_time", arguments={"timezone": "UTC"})]
    )
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        response = await client.responses.create(
            model=MODEL, input=[item, {"role": "user", "content": "time?"}]
        )
    assert response.output[0].namespace == "mcp__time"
    prompt = runtime.tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert prompt.index("# Tools") < prompt.index("time?")
