"""A scripted model behind the real gateway: the fake Responses server harness tests use.

`ScriptedEngine` replays a script of outputs (texts here, tokenized canonically with
the served model's tokenizer and ended with eos, as a model that stops would); the real
gateway serves it on a free loopback port, so a harness under test speaks the real wire
protocol (HTTP+SSE and WebSocket) to a model whose every answer is known.
`CannedMcpServers` is the fake behind the hosted MCP tool's seam (hosted/mcp.py).
`cycling_texts` and `offline_hosted` make a gateway that answers anything, forever,
without a network: what the contract tests and the fuzzer run against.
"""

import asyncio
import contextlib
import functools
import itertools
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

import uvicorn

from once.gateway.apis.responses.http import responses_encoder
from once.gateway.app import build_gateway_app, create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.hosted.base import HostedTools, ToolSearch
from once.gateway.hosted.mcp import UNREACHABLE, McpFailure, RemoteMcp
from once.gateway.hosted.programs import ProgrammaticToolCalling
from once.gateway.model import ModelRuntime
from once.gateway.pipeline import ResponsePipeline
from once.gateway.prepare import Prepared
from once.gateway.state.conversation import ConnectionCache
from once.model_files import DEFAULT_MODEL, find_model_folder, locate_model
from once.protocol.responses import parse_request
from once.protocol.scripted_engine import ScriptedEngine

START_TIMEOUT_S = 60  # a busy machine starts a server slowly; a healthy one in ~0.1 s


def load_runtime(model: str = DEFAULT_MODEL) -> ModelRuntime:
    if not locate_model(model).converted:
        # Converting a GGUF needs the engine (torch): `once model path` does it in its own
        # process, so the gateway's helpers never import once.engine.
        command = [sys.executable, "-m", "once.cli", "model", "path", model]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return ModelRuntime.load(model, find_model_folder(model), max_model_len=8192)


def scripted_texts(runtime: ModelRuntime, texts, **kwargs) -> ScriptedEngine:
    """An engine whose n-th response is texts[n], canonically tokenized, plus eos."""
    eos = runtime.tokenizer.eos_token_id
    outputs = [runtime.builder.encode(text) + [eos] for text in texts]
    return ScriptedEngine(outputs, eos_token_id=eos, **kwargs)


# Plain text, a tool call (of a tool the request may not have) and text past ASCII: what
# each encoder must carry whatever the request was.
CYCLED_OUTPUTS = (
    "ok",
    '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>',
    "Ünïcode ✓ 你好\n```json\n{}\n```",
)


def cycling_texts(runtime: ModelRuntime, texts=CYCLED_OUTPUTS) -> ScriptedEngine:
    """An engine that answers every request, with no end, with the next of `texts`."""
    eos = runtime.tokenizer.eos_token_id
    outputs = [runtime.builder.encode(text) + [eos] for text in texts]
    turns = itertools.count()
    return ScriptedEngine(lambda request: outputs[next(turns) % len(outputs)], eos_token_id=eos)


def offline_hosted() -> HostedTools:
    """The hosted tools `once serve` runs, with MCP servers that are never reachable."""
    return HostedTools([RemoteMcp(CannedMcpServers({})), ProgrammaticToolCalling(), ToolSearch()])


@contextlib.asynccontextmanager
async def serve_app(
    app,
    *,
    tls=None,
    force_exit: bool = False,
    send_buffer_bytes: int | None = None,
    **uvicorn_options,
):
    """Run an ASGI app on 127.0.0.1 with an OS-chosen port; yield (base URL, server).

    tls: (certfile, keyfile) for HTTPS. force_exit skips waiting for open streams at
    shutdown (tests that kill a server mid-stream). send_buffer_bytes: the kernel send
    buffer of every accepted connection (they inherit the listener's), for tests of slow
    readers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        **uvicorn_options,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        server.force_exit = force_exit
        await asyncio.wait_for(task, START_TIMEOUT_S)
        sock.close()


@contextlib.asynccontextmanager
async def serve_gateway(
    runtime: ModelRuntime,
    engine,
    config: GatewayConfig | None = None,
    safety=None,
    tls=None,
    hosted: HostedTools | None = None,
    send_buffer_bytes: int | None = None,
):
    """Start the gateway on 127.0.0.1; yield (base_url, gateway). tls: (certfile, keyfile)."""
    config = config or GatewayConfig(store="memory", verify_every=1)
    model = replace(runtime, safety=safety)
    gateway = create_gateway(config, engine, {runtime.name: model}, hosted=hosted)
    app = build_gateway_app(gateway)
    try:
        serving = serve_app(
            app, tls=tls, send_buffer_bytes=send_buffer_bytes, ws_max_size=config.max_body_bytes
        )
        async with serving as (url, _):
            yield url, gateway
    finally:
        await gateway.close()


class CannedMcpServers:
    """MCP servers without a network (hosted/mcp.py's `McpServers`): each `server_url`
    lists the tools given for it and answers calls with `answer(name, arguments)` ->
    (text, is_error); a URL not given cannot be reached. `calls` records what was asked."""

    def __init__(self, servers: dict[str, list[dict]], answer=None):
        self.servers = servers
        self.answer = answer or (lambda name, arguments: (f"{name} ok", False))
        self.calls: list[tuple[str, str, dict]] = []

    def _tools(self, config: dict) -> list[dict]:
        url = str(config.get("server_url"))
        if url not in self.servers:
            error = {"type": "http_error", "code": UNREACHABLE, "message": f"{url}: no server"}
            raise McpFailure(error)
        return self.servers[url]

    async def list_tools(self, config: dict) -> list[dict]:
        return [dict(tool) for tool in self._tools(config)]

    async def call_tool(self, config: dict, name: str, arguments: dict) -> tuple[str, bool]:
        self._tools(config)
        self.calls.append((str(config.get("server_url")), name, arguments))
        return self.answer(name, arguments)


# -- the pipeline without a server: tests that look inside one response ---------------------


def _transport(connection: ConnectionCache | None) -> str:
    return "http" if connection is None else "websocket"


async def prepare_request(
    pipeline: ResponsePipeline, body: dict, connection: ConnectionCache | None = None
) -> Prepared:
    """Admit and prepare a Responses body as the front end would (WebSocket rules with a
    connection)."""
    admission = await pipeline.admit(
        body,
        None,
        transport=_transport(connection),
        received_at=time.perf_counter(),
        parse=functools.partial(parse_request, websocket=connection is not None),
    )
    return await pipeline.prepare(admission, connection)


async def response_events(
    pipeline: ResponsePipeline, prepared: Prepared
) -> AsyncGenerator[dict, None]:
    """The Responses events of a prepared response, one by one."""
    encoder = responses_encoder(prepared)
    stream = pipeline.stream(prepared, encoder, _transport(prepared.connection), list)
    async with contextlib.aclosing(stream):
        async for batch in stream:
            for event in batch:
                yield event
