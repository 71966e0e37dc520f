"""A real gateway (uvicorn on a free loopback port) around a scripted engine.

The model side is SmolLM2's real tokenizer and chat template (the converted model folder),
with `ScriptedEngine` producing the token ids: what a test scripts as text is encoded
canonically and ended with eos, as a model that stops would.
"""

import asyncio
import contextlib
import socket
from dataclasses import replace

import pytest
import uvicorn

from once.engine.loader import resolve_model_path
from once.engine.scripted import ScriptedEngine
from once.gateway.app import build_gateway_app, create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.model import ModelRuntime

MODEL = "smollm2-135m-instruct"
TIMEOUT_S = 10


@pytest.fixture(scope="session")
def runtime() -> ModelRuntime:
    return ModelRuntime.load(MODEL, resolve_model_path(MODEL), max_model_len=8192)


def scripted_texts(runtime: ModelRuntime, texts, **kwargs) -> ScriptedEngine:
    """An engine whose n-th response is texts[n], canonically tokenized, plus eos."""
    eos = runtime.tokenizer.eos_token_id
    outputs = [runtime.builder.encode(text) + [eos] for text in texts]
    return ScriptedEngine(outputs, eos_token_id=eos, **kwargs)


@contextlib.asynccontextmanager
async def serve_gateway(
    runtime, engine, config: GatewayConfig | None = None, safety=None, tls=None
):
    """Start the gateway; yield (base_url, gateway). tls: (certfile, keyfile) for HTTPS."""
    config = config or GatewayConfig(store="memory", verify_every=1)
    model = replace(runtime, safety=safety)
    gateway = create_gateway(config, engine, {MODEL: model})
    app = build_gateway_app(gateway)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,
        ws_max_size=config.max_body_bytes,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    server = uvicorn.Server(uv)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}", gateway
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, TIMEOUT_S)
        sock.close()
        await gateway.service.store.close()
