"""Hosted tools served through an operator's MCP backend, against a real MCP server on
loopback: the scripted model calls `web_search`, the gateway calls the server's `search`
tool, the response holds a `web_search_call` and then the model's answer."""

import contextlib
import json
import socket

from mcp.server.mcpserver import MCPServer
from openai.types.responses import Response, ResponseFunctionWebSearch

from once.gateway.config import GatewayConfig
from once.gateway.testing import serve_app
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway
from tests.gateway.test_http import client_for, validate_events

CODEX_WEB_SEARCH = {"type": "web_search", "external_web_access": False,
                    "search_content_types": ["text", "image"]}  # fmt: skip


class SearchServer:
    def __init__(self):
        self.queries: list[str] = []
        self.url = ""
        self.server = server = MCPServer("search")

        @server.tool()
        def search(query: str) -> str:
            """Search the web."""
            self.queries.append(query)
            return f"once is a serving stack: https://example.com/{query}"

    @contextlib.asynccontextmanager
    async def serving(self):
        app = self.server.streamable_http_app()
        async with self.server.session_manager.run(), serve_app(app) as (url, _):
            self.url = f"{url}/mcp"
            yield self


def block(name: str, **payload) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, **payload}) + "\n</tool_call>"


def config(url: str) -> GatewayConfig:
    backends = {"web_search": {"server_url": url, "tool": "search"}}
    return GatewayConfig(store="memory", verify_every=1, hosted_backends=backends)


async def test_web_search_runs_on_the_backend_inside_the_response(runtime):
    texts = [block("web_search", arguments={"query": "once"}), "It is a serving stack.", "Bye."]
    engine = scripted_texts(runtime, texts)
    async with SearchServer().serving() as search:
        async with serve_gateway(runtime, engine, config(search.url)) as (url, _):
            async with client_for(url) as client:
                events = [
                    event
                    async for event in await client.responses.create(
                        model=MODEL, input="What is once?", tools=[CODEX_WEB_SEARCH],
                        stream=True, include=["web_search_call.action.sources"],
                    )
                ]  # fmt: skip
                validate_events(events)
                response = events[-1].response
                Response.model_validate(response.to_dict())
                call, message = response.output
                assert isinstance(call, ResponseFunctionWebSearch)
                assert (call.status, call.action.query) == ("completed", "once")
                assert call.action.sources[0].url == "https://example.com/once"
                assert message.content[0].text == "It is a serving stack."
                assert getattr(response, "once_ignored_tools", None) is None
                kinds = [e.type for e in events]
                order = ["response.web_search_call.in_progress",
                         "response.web_search_call.searching",
                         "response.web_search_call.completed"]  # fmt: skip
                assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order)
                again = await client.responses.create(
                    model=MODEL, input=[{"role": "user", "content": "What is once?"},
                                        *[i.model_dump(exclude_none=True) for i in response.output],
                                        {"role": "user", "content": "Thanks."}],
                    tools=[CODEX_WEB_SEARCH], store=False,
                )  # fmt: skip
                assert again.status == "completed"
    assert search.queries == ["once"]
    first, second, third = (runtime.tokenizer.decode(r.prompt_token_ids) for r in engine.requests)
    assert '"name":"web_search"' in first
    assert "<tool_response>\nonce is a serving stack: https://example.com/once" in second
    assert "<tool_response>\nonce is a serving stack" in third  # the item rendered back


async def test_a_backend_that_is_down_fails_the_item_not_the_response(runtime):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    texts = [block("web_search", arguments={"query": "x"}), "The search is down."]
    engine = scripted_texts(runtime, texts)
    async with serve_gateway(runtime, engine, config(closed)) as (url, _), client_for(url) as c:
        response = await c.responses.create(model=MODEL, input="Search x", tools=[CODEX_WEB_SEARCH])
        call, message = response.output
        assert (call.type, call.status, response.status) == (
            "web_search_call",
            "failed",
            "completed",
        )
    assert "<tool_response>\nerror:" in runtime.tokenizer.decode(
        engine.requests[1].prompt_token_ids
    )


async def test_without_a_backend_web_search_is_ignored(runtime):
    engine = scripted_texts(runtime, ["Hi."])
    async with serve_gateway(runtime, engine) as (url, _), client_for(url) as client:
        reply = await client.responses.with_raw_response.create(
            model=MODEL, input="hi", tools=[CODEX_WEB_SEARCH]
        )
        assert reply.headers["once-ignored-tools"] == "web_search"
    assert "web_search" not in runtime.tokenizer.decode(engine.requests[0].prompt_token_ids)


async def test_web_search_over_websocket(runtime):
    texts = [block("web_search", arguments={"query": "ws"}), "Found it."]
    engine = scripted_texts(runtime, texts)
    async with SearchServer().serving() as search:
        async with serve_gateway(runtime, engine, config(search.url)) as (url, _):
            async with client_for(url) as client, client.responses.connect() as connection:
                await connection.response.create(
                    model=MODEL, input="Search ws", tools=[CODEX_WEB_SEARCH]
                )
                events = []
                async for event in connection:
                    events.append(event)
                    if event.type == "response.completed":
                        break
                validate_events(events)
                call, message = events[-1].response.output
                assert (call.type, call.status, message.content[0].text) == (
                    "web_search_call", "completed", "Found it.",
                )  # fmt: skip
    assert search.queries == ["ws"]
