"""Remote MCP as a hosted tool, against a real MCP server over streamable HTTP on loopback.

The server is the `mcp` SDK's MCPServer with three tools; the scripted model calls them as
`docs.<tool>`. A response lists the server once per conversation (`mcp_list_tools`),
runs calls inside the response (`mcp_call`), and ends at a call that needs approval
(`mcp_approval_request`) until the next request approves or declines it. A server that
cannot be reached is an item's error, never a failed request. Every response and stream
event is parsed with the SDK's types.
"""

import contextlib
import json
import socket

import openai
import pytest
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from openai.types.responses import Response

from once.gateway.hosted.base import HostedTools
from once.gateway.hosted.mcp import RemoteMcp
from once.gateway.hosted.mcp_policy import is_allowed, needs_approval
from once.gateway.testing import CannedMcpServers, serve_app
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway
from tests.gateway.test_http import client_for, validate_events

QUESTION = [{"type": "message", "role": "user", "content": "What do the docs say?"}]


class DocsServer:
    """An MCP server with a read-only search, a destructive delete, and a failing tool."""

    def __init__(self):
        self.deleted: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self.server = server = MCPServer("docs")

        @server.tool(annotations=ToolAnnotations(read_only_hint=True))
        def search_docs(query: str) -> str:
            """Search the documentation."""
            return f"3 pages about {query}"

        @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
        def delete_page(page: str) -> str:
            """Delete a page."""
            self.deleted.append(page)
            return f"deleted {page}"

        @server.tool()
        def fail(reason: str) -> str:
            """Always fails."""
            raise ValueError(reason)

    @contextlib.asynccontextmanager
    async def serving(self):
        app = self.server.streamable_http_app()

        async def recording(scope, receive, send):  # the HTTP headers the gateway sent
            if scope["type"] == "http":
                self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        # Entered and left in the test's own task: the session manager's task group must be.
        async with self.server.session_manager.run(), serve_app(recording) as (url, _):
            self.url = f"{url}/mcp"
            yield self


def block(name: str, **payload) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, **payload}) + "\n</tool_call>"


def mcp_tool(url: str, **fields) -> dict:
    return {"type": "mcp", "server_label": "docs", "server_url": url, **fields}


async def streamed(client, **request):
    events = []
    async for event in await client.responses.create(stream=True, **request):
        events.append(event)
    validate_events(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("response.created") == 1  # one, over every step
    response = events[-1].response
    Response.model_validate(response.to_dict())
    return response, [event.type for event in events]


async def test_a_server_is_listed_once_and_its_tools_called_inside_the_response(runtime):
    texts = [block("docs.search_docs", arguments={"query": "ptc"}), "Three pages.", "Bye."]
    engine = scripted_texts(runtime, texts)
    gateway = serve_gateway(runtime, engine)
    async with DocsServer().serving() as docs, gateway as (url, _), client_for(url) as client:
        tool = mcp_tool(
            docs.url, allowed_tools=["search_docs"], require_approval="never",
            headers={"X-Docs-Token": "t0ken"},
        )  # fmt: skip
        first, events = await streamed(client, model=MODEL, input=QUESTION, tools=[tool])
        listing, call, message = first.output
        assert (listing.type, listing.server_label, listing.error) == (
            "mcp_list_tools",
            "docs",
            None,
        )
        assert [t.name for t in listing.tools] == ["search_docs"]  # allowed_tools only
        assert listing.tools[0].annotations["readOnlyHint"] is True
        assert listing.tools[0].input_schema["properties"]["query"]["type"] == "string"
        assert (call.type, call.name, json.loads(call.arguments)) == (
            "mcp_call", "search_docs", {"query": "ptc"},
        )  # fmt: skip
        assert (call.output, call.error, call.status) == ("3 pages about ptc", None, "completed")
        assert message.content[0].text == "Three pages."
        assert events.index("response.mcp_list_tools.in_progress") < events.index(
            "response.mcp_list_tools.completed"
        )
        for kind in ("mcp_call_arguments.delta", "mcp_call_arguments.done", "mcp_call.in_progress"):
            assert events.index(f"response.{kind}") < events.index("response.mcp_call.completed")
        assert events.count("response.output_item.added") == 3

        second = await client.responses.create(
            model=MODEL, previous_response_id=first.id, input="Thanks.", tools=[tool]
        )
        assert [item.type for item in second.output] == ["message"]  # listed already
    assert all(h.get("x-docs-token") == "t0ken" for h in docs.headers) and docs.headers
    listed, called, after = (runtime.tokenizer.decode(r.prompt_token_ids) for r in engine.requests)
    head, tail = listed.split("What do the docs say?")
    assert "search_docs" not in head and '"name":"docs"' in tail and "search_docs" in tail
    assert "delete_page" not in listed
    assert called.startswith(listed[: -len("<|im_start|>assistant\n")])
    assert "<tool_response>\n3 pages about ptc\n</tool_response>" in called
    assert after.count('"name":"docs"') == 1  # the listing where it was, once


async def test_a_call_needing_approval_waits_for_the_next_request(runtime):
    texts = [
        block("docs.search_docs", arguments={"query": "old"}),  # read-only: never asks
        block("docs.delete_page", arguments={"page": "p1"}),  # asks
        "Deleted p1.",
        block("docs.delete_page", arguments={"page": "p2"}),
        "I will not delete p2.",
    ]
    engine = scripted_texts(runtime, texts)
    gateway = serve_gateway(runtime, engine)
    async with DocsServer().serving() as docs, gateway as (url, _), client_for(url) as client:
        tool = mcp_tool(docs.url, require_approval={"never": {"read_only": True}})
        first, _ = await streamed(client, model=MODEL, input=QUESTION, tools=[tool])
        assert [i.type for i in first.output] == [
            "mcp_list_tools", "mcp_call", "mcp_approval_request",
        ]  # fmt: skip
        asked = first.output[2]
        assert (asked.name, json.loads(asked.arguments), asked.server_label) == (
            "delete_page", {"page": "p1"}, "docs",
        )  # fmt: skip
        assert docs.deleted == [] and first.status == "completed"

        approve = {"type": "mcp_approval_response", "approval_request_id": asked.id,
                   "approve": True}  # fmt: skip
        second, _ = await streamed(
            client, model=MODEL, previous_response_id=first.id, input=[approve], tools=[tool]
        )
        ran, message = second.output
        assert (ran.type, ran.approval_request_id, ran.output) == (
            "mcp_call", asked.id, "deleted p1",
        )  # fmt: skip
        assert docs.deleted == ["p1"] and message.content[0].text == "Deleted p1."

        third = await client.responses.create(
            model=MODEL, previous_response_id=second.id, input="Now p2.", tools=[tool]
        )
        (again,) = third.output
        decline = {"type": "mcp_approval_response", "approval_request_id": again.id,
                   "approve": False, "reason": "keep it"}  # fmt: skip
        fourth = await client.responses.create(
            model=MODEL, previous_response_id=third.id, input=[decline], tools=[tool]
        )
        assert [i.type for i in fourth.output] == ["message"] and docs.deleted == ["p1"]

        unknown = {**approve, "approval_request_id": "mcpr_nope"}
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=MODEL, previous_response_id=fourth.id, input=[unknown], tools=[tool]
            )
        assert refused.value.param == "input[0].approval_request_id"
    prompts = [runtime.tokenizer.decode(r.prompt_token_ids) for r in engine.requests]
    assert "<tool_response>\ndeleted p1\n</tool_response>" in prompts[2]
    assert prompts[2].count('"name": "docs.delete_page"') == 1  # asked once, shown once
    assert "The call was not approved. Reason: keep it" in prompts[4]


async def test_an_unreachable_server_is_an_item_error_not_a_failed_response(runtime):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    texts = [
        "The docs are down.",
        "Listed.",
        block("docs.search_docs", arguments={"query": "x"}),
        "Down.",
    ]
    engine = scripted_texts(runtime, texts)
    gateway = serve_gateway(runtime, engine)
    async with DocsServer().serving() as docs, gateway as (url, _), client_for(url) as client:
        first, events = await streamed(
            client, model=MODEL, input=QUESTION, tools=[mcp_tool(closed, require_approval="never")]
        )
        listing, message = first.output
        assert listing.type == "mcp_list_tools" and listing.tools == []
        assert "could not be reached" in listing.error
        assert "response.mcp_list_tools.failed" in events and first.status == "completed"
        assert message.content[0].text == "The docs are down."

        # A listing that worked, from a server that has gone since: the call fails alone.
        listed = await client.responses.create(
            model=MODEL, input=QUESTION, tools=[mcp_tool(docs.url, require_approval="never")],
            store=False,
        )  # fmt: skip
        resent = [*QUESTION, listed.output[0].model_dump(exclude_none=True)]
        second, events = await streamed(
            client, model=MODEL, input=resent, store=False,
            tools=[mcp_tool(closed, require_approval="never")],
        )  # fmt: skip
        call, message = second.output
        assert call.type == "mcp_call" and call.status == "failed" and call.output is None
        assert (call.error.type, call.error.code) == ("http_error", 502)
        assert "response.mcp_call.failed" in events and message.content[0].text == "Down."
    assert "could not list its tools" in runtime.tokenizer.decode(
        engine.requests[0].prompt_token_ids
    )


def test_allowed_tools_and_approval_filters():
    search = {"name": "search_docs", "annotations": {"readOnlyHint": True}}
    delete = {"name": "delete_page", "annotations": {"readOnlyHint": False}}
    bare = {"name": "ping"}
    assert is_allowed({}, delete) and not is_allowed({"allowed_tools": ["ping"]}, delete)
    by_filter = {"allowed_tools": {"read_only": True}}
    assert is_allowed(by_filter, search) and not is_allowed(by_filter, delete)
    assert not is_allowed(by_filter, bare)  # no annotation: not known to be read-only
    assert needs_approval({}, search)  # the API's default: always
    assert not needs_approval({"require_approval": "never"}, delete)
    never_read_only = {"require_approval": {"never": {"read_only": True}}}
    assert not needs_approval(never_read_only, search) and needs_approval(never_read_only, delete)
    by_name = {"require_approval": {"never": {"tool_names": ["ping"]}, "always": {}}}
    assert not needs_approval(by_name, bare) and needs_approval(by_name, search)


async def test_a_tool_error_and_an_unlisted_tool_are_call_errors(runtime):
    servers = CannedMcpServers(
        {"http://docs.test/mcp": [{"name": "search_docs", "input_schema": {"type": "object"}}]},
        answer=lambda name, arguments: ("index offline", True),
    )
    hosted = HostedTools([RemoteMcp(servers)])
    texts = [
        block("docs.search_docs", arguments={"query": "x"}),
        block("docs.drop_all", arguments={}),  # not listed: never sent to the server
        "Both failed.",
    ]
    engine = scripted_texts(runtime, texts)
    tool = mcp_tool("http://docs.test/mcp", require_approval="never")
    async with serve_gateway(runtime, engine, hosted=hosted) as (url, _):
        async with client_for(url) as client:
            response, events = await streamed(client, model=MODEL, input=QUESTION, tools=[tool])
    _, failed, refused, _ = response.output
    assert (failed.status, failed.error.type) == ("failed", "mcp_tool_execution_error")
    assert failed.error.content == [{"type": "text", "text": "index offline"}]
    assert (refused.error.type, refused.error.code) == ("mcp_protocol_error", -32602)
    assert "drop_all" in refused.error.message and events.count("response.mcp_call.failed") == 2
    assert servers.calls == [("http://docs.test/mcp", "search_docs", {"query": "x"})]
    last = runtime.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert "<tool_response>\nerror: index offline\n</tool_response>" in last
