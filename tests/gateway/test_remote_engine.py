"""The gateway in front of the router and a remote engine (`once engine` over HTTP): every
finished response hands its HTTP connection back to the engine client's pool."""

import asyncio

import httpx
import openai
import pytest

from once.agent.transport.websocket import WebSocketTransport
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app
from once.gateway.testing import serve_app
from once.router.replicas import Replica
from once.router.router import Router, RouterConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway


@pytest.mark.parametrize(
    "routed, token_latency_s",
    [(True, 0.0), (False, 0.001), (True, 0.001)],
    ids=["routed-burst", "direct-paced", "routed-paced"],
)
async def test_finished_responses_give_their_engine_connections_back(
    runtime, routed, token_latency_s
):
    """A pool of 2 connections: one kept by a finished response blocks the third call.
    Paced deltas (a millisecond apart, as a real engine sends them) are the hard case: the
    gateway's reader of the engine is still closing the HTTP stream when the final event
    goes out, and cancelling it there (or aborting a finished request) leaked one pooled
    connection per response."""
    texts = [f"Answer number {i}." for i in range(6)]
    engine = scripted_texts(runtime, texts, token_latency_s=token_latency_s)
    async with serve_app(build_engine_app(engine, model_name=MODEL)) as (engine_url, _):
        pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=2))
        remote = RemoteEngineClient(engine_url, transport=pool)
        upstream = remote
        if routed:
            replica = Replica("r", remote, index=0, block_size=16, kv_blocks_total=64)
            upstream = Router([replica], RouterConfig(policy="round_robin"))
        try:
            async with serve_gateway(runtime, upstream) as (url, _):
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
                transport = WebSocketTransport(client, http_fallback=False)
                try:
                    async with asyncio.timeout(10):
                        for i, text in enumerate(texts[:3]):
                            stream = await client.responses.create(
                                model=MODEL, input=f"question {i}", stream=True
                            )
                            events = [event async for event in stream]
                            assert events[-1].response.output_text == text
                        for i, text in enumerate(texts[3:], start=3):
                            request = {"model": MODEL, "input": f"question {i}"}
                            response = await transport.create(request)
                            assert response["status"] == "completed"
                            assert response["output"][0]["content"][0]["text"] == text
                finally:
                    await transport.close()
                    await client.close()
        finally:
            if routed:
                await upstream.aclose()
            await remote.aclose()
