"""The gateway restarted mid-session, on the same SQLite store.

A gateway process (a scripted engine inside, the store a SQLite file) serves two sessions:
the harness's WebSocket transport (two turns, the second sent as
`{previous_response_id, new items}`) and an HTTP client chaining `previous_response_id`.
Between turns the gateway is SIGKILLed and started again on the same port and file. What
must hold:

- every response acknowledged before the kill is returned by `GET /v1/responses/{id}`
  after it, unchanged;
- the HTTP chain continues from its last response (`previous_response_id`), and
  `input_items` of the next response lists the whole conversation;
- the WebSocket session continues: its old connection is dead, so its transport opens a
  new one and resends the full request (the recovery ladder), with no HTTP fallback.
"""

import asyncio

import httpx
import openai

from once.agent.transport.websocket import WebSocketTransport
from once.bench.reliability.fault_kit import FaultContext, FaultResult, output_text, user
from once.bench.reliability.fault_servers import running
from once.gateway.testing import DEFAULT_MODEL

REPLY = "Noted, and carrying on."
INSTRUCTIONS = "You are a test assistant."
TURN_TIMEOUT_S = 30.0


def _request(conversation: list[dict]) -> dict:
    return {"model": DEFAULT_MODEL, "instructions": INSTRUCTIONS, "input": list(conversation)}


async def _http_turn(http: httpx.AsyncClient, text: str, previous_id: str | None) -> dict:
    body = {"model": DEFAULT_MODEL, "input": [user(text)], "store": True}
    if previous_id is not None:
        body["previous_response_id"] = previous_id
    reply = await http.post("/v1/responses", json=body)
    return reply.json() if reply.status_code == 200 else {"status": "failed", **reply.json()}


async def gateway_restarted_mid_session(context: FaultContext) -> FaultResult:
    folder = context.folder("gateway_restarted")
    store = f"sqlite:///{folder / 'responses.db'}"
    args = ["gateway", "--store", store, "--reply", REPLY]
    async with running(args, folder) as gateway:
        client = openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=TURN_TIMEOUT_S
        )
        transport = WebSocketTransport(client)
        http = httpx.AsyncClient(base_url=gateway.url, timeout=TURN_TIMEOUT_S)
        try:
            async with asyncio.timeout(TURN_TIMEOUT_S * 4):
                conversation = [user("first question")]
                acknowledged: dict[str, dict] = {}
                for text in ("second question", None):
                    response = await transport.create(_request(conversation))
                    acknowledged[response["id"]] = response
                    conversation += response["output"]
                    if text is not None:
                        conversation.append(user(text))
                chain: list[dict] = []
                for text in ("http one", "http two"):
                    chain.append(await _http_turn(http, text, chain[-1]["id"] if chain else None))
                    acknowledged[chain[-1]["id"]] = chain[-1]
                before = (transport.stats.reconnects, transport.stats.full_calls)

                gateway.kill()
                await gateway.restart()

                found: dict[str, dict | None] = {}
                for response_id in acknowledged:
                    reply = await http.get(f"/v1/responses/{response_id}")
                    found[response_id] = reply.json() if reply.status_code == 200 else None
                http_next = await _http_turn(http, "http three", chain[-1]["id"])
                listed = await http.get(f"/v1/responses/{http_next.get('id')}/input_items")
                listed_items = listed.json().get("data", []) if listed.status_code == 200 else []
                conversation.append(user("third question"))
                ws_next = await transport.create(_request(conversation))
        finally:
            await transport.close()
            await http.aclose()
            await client.close()

    def survived(response: dict) -> bool:
        after = found[response["id"]]
        return after is not None and (after["status"], output_text(after)) == (
            response["status"],
            output_text(response),
        )

    lost = [response_id for response_id, response in acknowledged.items() if not survived(response)]
    stats = transport.stats
    http_continued = http_next.get("status") == "completed" and output_text(http_next) == REPLY
    ws_continued = ws_next.get("status") == "completed" and output_text(ws_next) == REPLY
    checks = {
        "stored responses survive the restart": not lost,
        "the HTTP chain continues by previous_response_id": http_continued,
        "input_items lists the whole chain (3 inputs, 2 outputs)": len(listed_items) == 5,
        "the WebSocket session continues on a new connection": ws_continued,
        "it reconnected once and resent in full": stats.reconnects == before[0] + 1
        and stats.full_calls == before[1] + 1,
        "no HTTP fallback was needed": stats.http_fallbacks == 0,
    }
    return FaultResult(
        "gateway_restarted",
        checks,
        sessions_lost=(not http_continued) + (not ws_continued),
        stored_responses_lost=len(lost),
        detail={
            "responses_stored_before_restart": len(acknowledged),
            "found_after_restart": len(acknowledged) - len(lost),
            "gateway_starts": gateway.num_starts,
            "websocket_reconnects": stats.reconnects,
            "websocket_full_calls": stats.full_calls,
            "websocket_incremental_calls": stats.incremental_calls,
        },
    )
