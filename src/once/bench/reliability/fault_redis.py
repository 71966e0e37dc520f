"""Redis killed and restarted under a shared response store and shared rate limits.

A gateway (in process, scripted engine) keeps its responses and its tenants' rate limits
in one Redis (a `redis-server` of our own on a free loopback port, append-only file
fsynced on every write, in a scratch folder). Responses are stored; Redis is SIGKILLed;
the gateway goes on; Redis comes back on the same port and file. What must hold:

- while Redis is down: a new response streams whole and says it was not stored
  (`store: false`, `once_store_error`, the store-failure counter); the rate limits let
  requests through (the documented fallback); reading a stored response or continuing
  one over HTTP is a clear 503 `response_store_unavailable`; a WebSocket session goes on
  from its connection's own state;
- once it is back: every response stored before is found, the HTTP chain continues,
  new responses are stored again;
- Redis frozen (SIGSTOP: connected, silent): a response costs the gateway's Redis
  timeouts (`redis_timeout_s`, the rate limits' and the store's), then streams whole,
  not stored; nothing hangs, and what was stored is there once Redis thaws.
"""

import time
from pathlib import Path

import httpx
import openai

from once.agent.transport.websocket import WebSocketTransport
from once.bench.local_redis import redis_server
from once.bench.reliability.fault_kit import (
    FaultContext,
    FaultResult,
    final_response,
    output_text,
    stream_response,
    user,
)
from once.gateway.apis.responses.events import STORE_ERROR_FIELD
from once.gateway.config import GatewayConfig
from once.gateway.testing import DEFAULT_MODEL, serve_gateway
from once.protocol.scripted_engine import ScriptedEngine

API_KEY = "sk-faults"
REQUEST_TIMEOUT_S = 30.0  # hang guard of every request
# The gateway's per-call bound, for the frozen Redis; a slow fsync on a busy disk stays inside.
REDIS_TIMEOUT_S = 2.0


def _keys_file(folder: Path) -> Path:
    path = folder / "keys.toml"
    path.write_text(
        f'[[keys]]\nkey = "{API_KEY}"\ntenant = "acme"\n'
        "requests_per_minute = 10000\ntokens_per_minute = 10000000\n"
    )
    return path


async def redis_stopped_and_restarted(context: FaultContext) -> FaultResult:
    folder = context.folder("redis_restarted")
    runtime = context.runtime
    eos = runtime.tokenizer.eos_token_id
    reply = runtime.builder.encode("Stored or not, here it is.") + [eos]
    engine = ScriptedEngine(lambda request: reply, eos_token_id=eos)
    async with redis_server(folder) as redis:
        config = GatewayConfig(
            store=redis.url,
            rate_limit_storage=redis.url,
            api_keys_file=str(_keys_file(folder)),
            redis_timeout_s=REDIS_TIMEOUT_S,
            verify_every=1,
        )
        async with (
            serve_gateway(runtime, engine, config) as (url, gateway),
            httpx.AsyncClient(
                base_url=url,
                timeout=REQUEST_TIMEOUT_S,
                headers={"authorization": f"Bearer {API_KEY}"},
            ) as http,
        ):

            async def respond(text: str, previous_id: str | None = None) -> dict:
                body: dict = {"model": DEFAULT_MODEL, "input": [user(text)], "store": True}
                if previous_id is not None:
                    body["previous_response_id"] = previous_id
                events = await stream_response(http, url, body)
                return final_response(events) or events[-1]

            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S
            )
            websocket = WebSocketTransport(client, http_fallback=False)
            try:
                conversation = [user("over the websocket")]
                first = await websocket.create({"model": DEFAULT_MODEL, "input": conversation})
                stored = [first] + [await respond(f"before {i}") for i in range(3)]
                redis.kill()
                started = time.perf_counter()
                down_new = await respond("while down")
                down_continue = await respond("continue while down", stored[-1]["id"])
                down_get = await http.get(f"/v1/responses/{stored[0]['id']}")
                conversation = conversation + first["output"] + [user("still there?")]
                ws_down = await websocket.create({"model": DEFAULT_MODEL, "input": conversation})
                down_s = time.perf_counter() - started
            finally:
                await websocket.close()
                await client.close()
            await redis.start()
            found = [await http.get(f"/v1/responses/{r['id']}") for r in stored]
            back_continue = await respond("continue once back", stored[-1]["id"])
            back_get = await http.get(f"/v1/responses/{back_continue['id']}")
            redis.freeze()
            started = time.perf_counter()
            frozen_new = await respond("while frozen")
            frozen_s = time.perf_counter() - started
            redis.freeze(False)
            thawed_get = await http.get(f"/v1/responses/{back_continue['id']}")
            metrics = gateway.metrics
            store_failures = metrics.value(metrics.store_failures)

    lost = sum(
        reply.status_code != 200 or output_text(reply.json()) != output_text(response)
        for reply, response in zip(found, stored, strict=True)
    )
    store_error = down_new.get(STORE_ERROR_FIELD) or {}
    continue_error = (down_continue.get("error") or {}).get("code")
    get_error = (down_get.json().get("error") or {}).get("code")
    checks = {
        "a response streams whole while Redis is down": down_new.get("status") == "completed",
        "it says it was not stored": down_new.get("store") is False
        and store_error.get("code") == "response_store_unavailable",
        "the rate limits let it through": down_new.get("status") != 429,
        "the store failures are counted": store_failures == 3,
        "the WebSocket session goes on from its connection": ws_down.get("status") == "completed"
        and websocket.stats.incremental_calls == 1,
        "continuing over HTTP while down is a clear 503": down_continue.get("status") == 503
        and continue_error == "response_store_unavailable",
        "reading a stored response while down is a clear 503": down_get.status_code == 503
        and get_error == "response_store_unavailable",
        "the chain continues once Redis is back": back_continue.get("status") == "completed",
        "new responses are stored once it is back": back_get.status_code == 200,
        "a frozen Redis costs timeouts, not a hang": frozen_new.get("status") == "completed"
        and frozen_new.get("store") is False,
        "what was stored is there once it thaws": thawed_get.status_code == 200,
    }
    return FaultResult(
        "redis_restarted",
        checks,
        sessions_lost=(back_continue.get("status") != "completed")
        + (ws_down.get("status") != "completed"),
        stored_responses_lost=lost,
        detail={
            "stored_before": len(stored),
            "found_after": len(stored) - lost,
            "seconds_for_four_requests_while_down": round(down_s, 3),
            "redis_timeout_s": REDIS_TIMEOUT_S,
            "seconds_for_a_request_while_frozen": round(frozen_s, 3),
            "store_failures": store_failures,
            "websocket_incremental_calls_while_down": websocket.stats.incremental_calls,
        },
    )
