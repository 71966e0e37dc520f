"""A client that leaves a non-streamed request: the engine request is aborted.

Streaming, a disconnect closes the stream (Starlette listens for it). Not streaming,
nothing is written until the end, so the gateway must watch the connection itself: a
client gone after the engine started must not keep it decoding (issue 33: one decoded
~100 s more, and a short chat waited minutes behind an abandoned 14k-token request).

The scripted engine plays a long answer slowly (minutes in all), so a request that is not
aborted ends "stop" or "length", never "abort"; the test waits for the engine's own word
on how it ended, to a generous deadline.
"""

import asyncio

import httpx
import pytest

from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

LONG_TEXT = " ".join(f"word{i}" for i in range(400))
BODIES = {
    "/v1/responses": {"model": MODEL, "input": "Talk."},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Talk."}]},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "Talk."}],
    },
}
HEADERS = {"authorization": "Bearer sk-test"}


async def leave_after_the_engine_starts(url: str, path: str, engine) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        call = asyncio.create_task(client.post(path, json=BODIES[path], headers=HEADERS))
        async with asyncio.timeout(30):
            while not engine.requests:
                await asyncio.sleep(0.01)
        call.cancel()  # the client gives up: httpx drops the connection
        with pytest.raises(asyncio.CancelledError):
            await call


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_client_leaving_a_non_streamed_request_aborts_the_engine(runtime, path):
    engine = scripted_texts(runtime, [LONG_TEXT, "Next."], token_latency_s=0.2)
    async with serve_gateway(runtime, engine) as (url, gateway):
        await leave_after_the_engine_starts(url, path, engine)
        request_id = engine.requests[0].request_id
        async with asyncio.timeout(60):
            while request_id not in engine.finish_reasons:
                await asyncio.sleep(0.02)
        assert engine.finish_reasons[request_id] == "abort"
        stats = await engine.stats()
        assert stats["num_generated_tokens"] < 300  # of ~800 the script holds
        async with asyncio.timeout(30):
            while gateway.metrics.inflight._value.get() != 0:
                await asyncio.sleep(0.02)
        # The gateway serves the next request as usual.
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            reply = await client.post(path, json=BODIES[path], headers=HEADERS)
        assert reply.status_code == 200
        assert "Next." in reply.text
