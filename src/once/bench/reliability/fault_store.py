"""The SQLite response store out of room.

How the disk fills: the store's file is capped (`store_max_bytes`, SQLite's
`max_page_count`), so a put past the cap fails with SQLITE_FULL, the error a full disk
gives, without needing a small filesystem mounted as root. A gateway (in process, scripted
engine) stores responses until the file is full. What must hold:

- every response streams whole; one that could not be stored says so in its final event
  and in a non-streaming reply (`store: false`, `once_store_error`), is counted
  (`once_gateway_store_failures_total`) and logged;
- nothing half-written: each refused response reads as not found, every acknowledged one
  reads back unchanged, and the file passes SQLite's integrity check holding exactly the
  acknowledged rows;
- a WebSocket session goes on from its connection's state, store or no store;
- once room is made (responses deleted), responses are stored again.
"""

import logging
import sqlite3

import httpx
import openai

from once.agent.transport.websocket import WebSocketTransport
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

STORE_MAX_BYTES = 96 * 1024  # a few dozen responses of the size sent here
MAX_REQUESTS = 60  # the file is full well before this
FILLER = "Here is some context for the record, written out at length. " * 25
REQUEST_TIMEOUT_S = 30.0


class _CountWarnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _stored(response: dict) -> bool:
    return response.get("store") is True and STORE_ERROR_FIELD not in response


async def store_disk_full(context: FaultContext) -> FaultResult:
    folder = context.folder("store_disk_full")
    db = folder / "responses.db"
    runtime = context.runtime
    eos = runtime.tokenizer.eos_token_id
    reply = runtime.builder.encode("Recorded.") + [eos]
    engine = ScriptedEngine(lambda request: reply, eos_token_id=eos)
    config = GatewayConfig(store=f"sqlite:///{db}", store_max_bytes=STORE_MAX_BYTES)
    warnings = _CountWarnings()
    logging.getLogger("once.gateway.pipeline").addHandler(warnings)
    try:
        async with (
            serve_gateway(runtime, engine, config) as (url, gateway),
            httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http,
        ):
            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
            )
            websocket = WebSocketTransport(client, http_fallback=False)
            try:
                conversation = [user("a session over the websocket")]
                first = await websocket.create({"model": DEFAULT_MODEL, "input": conversation})
                responses = [first]
                for i in range(MAX_REQUESTS):
                    body = {"model": DEFAULT_MODEL, "input": [user(f"{i}: {FILLER}")]}
                    events = await stream_response(http, url, body)
                    responses.append(final_response(events) or {})
                    if sum(not _stored(r) for r in responses) >= 3:
                        break
                plain = await http.post("/v1/responses", json={**body, "stream": False})
                conversation = conversation + first["output"] + [user("and now?")]
                ws_next = await websocket.create({"model": DEFAULT_MODEL, "input": conversation})
            finally:
                await websocket.close()
                await client.close()
            acked = [r for r in responses if _stored(r)]
            refused = [r for r in responses if not _stored(r)] + [plain.json(), ws_next]
            found = {r["id"]: await http.get(f"/v1/responses/{r['id']}") for r in acked}
            refused_found = [await http.get(f"/v1/responses/{r['id']}") for r in refused]
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as check:
                integrity = check.execute("PRAGMA integrity_check").fetchone()[0]
                num_rows = check.execute("SELECT count(*) FROM responses").fetchone()[0]
            for response in acked[:4]:  # make room
                await http.delete(f"/v1/responses/{response['id']}")
            events = await stream_response(http, url, {"model": DEFAULT_MODEL, "input": "again"})
            after_room = final_response(events) or {}
            metrics = gateway.metrics
            store_failures = metrics.value(metrics.store_failures)
    finally:
        logging.getLogger("once.gateway.pipeline").removeHandler(warnings)

    lost = sum(
        reply.status_code != 200 or output_text(reply.json()) != output_text(response)
        for response, reply in zip(acked, found.values(), strict=True)
    )
    errors = [r.get(STORE_ERROR_FIELD) or {} for r in refused]
    checks = {
        "the store filled up": len(refused) >= 3,
        "every response streamed whole": all(
            r.get("status") == "completed" for r in responses + [plain.json(), ws_next]
        ),
        "refused responses say store false with the store's error": all(
            r.get("store") is False and e.get("code") == "response_store_unavailable"
            for r, e in zip(refused, errors, strict=True)
        ),
        "each failure is counted and logged": store_failures == len(refused)
        and sum("was not stored" in m for m in warnings.messages) == len(refused),
        "refused responses read as not found": all(r.status_code == 404 for r in refused_found),
        "the file is intact with exactly the acknowledged rows": integrity == "ok"
        and num_rows == len(acked),
        "the WebSocket session goes on from its connection": ws_next.get("status") == "completed"
        and websocket.stats.incremental_calls == 1,
        "responses are stored again once there is room": _stored(after_room),
    }
    return FaultResult(
        "store_disk_full",
        checks,
        sessions_lost=int(ws_next.get("status") != "completed"),
        stored_responses_lost=lost,
        detail={
            "disk_full_by": f"SQLite max_page_count, a {STORE_MAX_BYTES // 1024} KiB cap",
            "responses": len(responses) + 2,  # with the plain reply and the second WS turn
            "stored": len(acked),
            "refused": len(refused),
            "store_failures_counted": store_failures,
            "integrity_check": integrity,
        },
    )
