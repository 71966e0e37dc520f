"""Abandoned requests: what the engine still produces after a client has left.

A client gives up on a request while the engine decodes it, at every door a request has:
the Responses API, Chat Completions and Anthropic Messages over HTTP, each non-streamed
and streamed, and the Responses API over WebSocket. The gateway must abort the engine
request; `abandoned_tokens_after_1s` counts the output tokens the engine produced more
than 1 s after the client left (bar: 0), summed over every case.

The engine is the scripted one (protocol/scripted_engine.py) at `TOKEN_RATE` tokens/s per
request, wrapped so that the time of every token it hands out is kept; the gateway is the real one,
in this process, on a loopback port. The client leaves once `LEAVE_AFTER_TOKENS` tokens
are out (the engine is decoding, not queued), by dropping its connection. Each case waits
for the engine's own end of the request (to `END_DEADLINE_S`), so a request left running
shows up as tokens after the mark, not as a time-out. Before issue 33, every non-streamed
case decoded to its end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import websockets

from once.gateway.config import GatewayConfig
from once.gateway.testing import DEFAULT_MODEL, load_runtime, serve_gateway
from once.protocol.engine import GenerateRequest, TokenDelta
from once.protocol.scripted_engine import ScriptedEngine

TOKEN_RATE = 20.0  # tokens/s: about the real 360M model's decode rate on this CPU
NUM_SCRIPT_TOKENS = 2000  # 100 s at TOKEN_RATE: far past every wait here
LEAVE_AFTER_TOKENS = 5
GRACE_S = 1.0  # tokens within this long after the client left are not counted
END_DEADLINE_S = 30.0
USER = [{"role": "user", "content": "Tell me a long story."}]
CASES: dict[str, tuple[str, dict, bool]] = {  # name: (path, body, streamed)
    "responses_json": ("/v1/responses", {"input": "Tell me a long story."}, False),
    "responses_sse": ("/v1/responses", {"input": "Tell me a long story.", "stream": True}, True),
    "chat_json": ("/v1/chat/completions", {"messages": USER}, False),
    "chat_sse": ("/v1/chat/completions", {"messages": USER, "stream": True}, True),
    "messages_json": ("/v1/messages", {"messages": USER, "max_tokens": 4000}, False),
    "messages_sse": ("/v1/messages", {"messages": USER, "max_tokens": 4000, "stream": True}, True),
    "responses_ws": ("/v1/responses", {"input": "Tell me a long story."}, True),
}


class TimedEngine(ScriptedEngine):
    """The scripted engine, keeping when each of its tokens went out, per request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_times: dict[str, list[float]] = {}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        times = self.token_times.setdefault(request.request_id, [])
        async for delta in super().generate(request):
            times.extend([time.monotonic()] * len(delta.token_ids))
            yield delta


async def _leave_http(url: str, path: str, body: dict, engine: TimedEngine) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        call = asyncio.create_task(client.post(path, json=body))
        await _until_tokens_out(engine)
        call.cancel()  # the connection is dropped, as a client that gives up does
        await asyncio.gather(call, return_exceptions=True)
        return time.monotonic()


async def _leave_ws(url: str, body: dict, engine: TimedEngine) -> float:
    ws_url = url.replace("http://", "ws://") + "/v1/responses"
    async with websockets.connect(ws_url) as socket:
        await socket.send(json.dumps({"type": "response.create", **body}))
        await _until_tokens_out(engine)
    return time.monotonic()  # the socket closed on the way out


async def _until_tokens_out(engine: TimedEngine) -> None:
    async with asyncio.timeout(END_DEADLINE_S):
        while not engine.token_times or len(_last(engine)) < LEAVE_AFTER_TOKENS:
            await asyncio.sleep(0.01)


def _last(engine: TimedEngine) -> list[float]:
    return next(reversed(engine.token_times.values()))


async def run_case(runtime, name: str) -> dict:
    path, body, _ = CASES[name]
    eos = runtime.tokenizer.eos_token_id
    script = [runtime.builder.encode(" word") * NUM_SCRIPT_TOKENS]
    engine = TimedEngine(script, eos_token_id=eos, token_latency_s=1 / TOKEN_RATE)
    config = GatewayConfig(store="memory", verify_every=32)
    async with serve_gateway(runtime, engine, config) as (url, _):
        full = {"model": runtime.name, **body}
        if name.endswith("_ws"):
            left_at = await _leave_ws(url, full, engine)
        else:
            left_at = await _leave_http(url, path, full, engine)
        request_id = next(iter(engine.token_times))
        try:
            async with asyncio.timeout(END_DEADLINE_S):
                while request_id not in engine.finish_reasons:
                    await asyncio.sleep(0.02)
        except TimeoutError:
            pass  # still decoding: its late tokens so far are counted
        times = list(engine.token_times[request_id])
    late = sum(1 for t in times if t > left_at + GRACE_S)
    finish = engine.finish_reasons.get(request_id, "running")
    return {"tokens": len(times), "late": late, "finish": finish}


async def _run_all(model: str) -> dict:
    runtime = load_runtime(model)
    return {name: await run_case(runtime, name) for name in CASES}


def run_abandoned(model: str = DEFAULT_MODEL) -> dict:
    cases = asyncio.run(_run_all(model))
    return {
        "abandoned_requests": len(cases),
        "abandoned_tokens_after_1s": sum(case["late"] for case in cases.values()),
        "abandoned_cases": cases,
    }
