"""What refusing an over-long prompt costs the gateway: CPU time per rejection.

A prompt of 1, 5 and 20 MB of text goes to every door a prompt has: the Responses API
over HTTP and over WebSocket, Chat Completions, Anthropic Messages, and the two token
counters (`/v1/responses/input_tokens`, `/v1/messages/count_tokens`), with the served
model's context (SmolLM2: 8192 tokens; its longest token is 81 characters, so the bound
proves anything above ~660k characters too long). Each must come back
`context_length_exceeded` (a 400, or an error frame) without being tokenized: the
gateway's character bound (prepare.py) proves it too long first. The cost is the CPU
time of the gateway process over the request, all its threads (process.py: schedstat,
in nanoseconds), not wall time, so the figure does not depend on what else the machine
runs. Each case runs once unmeasured (first use of a path), then `repeats` times;
`max_rejection_cpu_ms` is the largest single measurement of all cases.
"""

from __future__ import annotations

import json
import time

import httpx
from websockets.sync.client import connect

from once.bench.gateway_bench.scripted_server import MODEL
from once.bench.reliability.process import GatewayProcess

SIZES_MB = (1, 5, 20)
CODE = "context_length_exceeded"
# Prose of ASCII words: what a pasted log or file looks like; 5 characters a word.
WORDS = "the test fails because the import path points at an old module ".split()
SETTLE_S = 0.05  # the server's work after the reply (metrics, logging) is counted too


def prompt_text(num_bytes: int) -> str:
    words = " ".join(WORDS) + " "
    return (words * (num_bytes // len(words) + 1))[:num_bytes]


def case_body(door: str, text: str) -> dict:
    user = [{"role": "user", "content": text}]
    if door in ("responses_http", "responses_ws", "responses_input_tokens"):
        return {"model": MODEL, "input": text}
    if door == "chat_http":
        return {"model": MODEL, "messages": user}
    if door == "messages_http":
        return {"model": MODEL, "max_tokens": 16, "messages": user}
    if door == "messages_count_tokens":
        return {"model": MODEL, "messages": user}
    raise ValueError(f"unknown door {door!r}")


DOORS = {
    "responses_http": "/v1/responses",
    "responses_ws": "/v1/responses",
    "chat_http": "/v1/chat/completions",
    "messages_http": "/v1/messages",
    "responses_input_tokens": "/v1/responses/input_tokens",
    "messages_count_tokens": "/v1/messages/count_tokens",
}


def error_code(door: str, status: int | None, reply: dict) -> str | None:
    error = reply.get("error")
    if not isinstance(error, dict):
        return None
    if door.startswith("messages"):
        # Anthropic's error body has a type and a message, no code: the message says it.
        too_long = status == 400 and "this model's context is" in str(error.get("message"))
        return CODE if too_long else error.get("type")
    return error.get("code")


def send_once(gateway: GatewayProcess, http: httpx.Client, door: str, body: bytes) -> dict:
    """One request; what came back and the gateway's CPU over it."""
    cpu_before = gateway.cpu_s()
    if door == "responses_ws":
        url = gateway.url.replace("http://", "ws://") + DOORS[door]
        with connect(url, compression=None, max_size=None, open_timeout=30) as socket:
            socket.send(b'{"type":"response.create",' + body[1:], text=True)
            reply = json.loads(socket.recv(timeout=120))
            status = reply.get("status")
    else:
        response = http.post(DOORS[door], content=body)
        status, reply = response.status_code, response.json()
    time.sleep(SETTLE_S)
    cpu_ms = 1000 * (gateway.cpu_s() - cpu_before)
    return {"status": status, "code": error_code(door, status, reply), "cpu_ms": cpu_ms}


def run_rejection(sizes_mb=SIZES_MB, repeats: int = 3) -> dict:
    cases = []
    with GatewayProcess() as gateway, httpx.Client(base_url=gateway.url, timeout=120) as http:
        for door in DOORS:
            for size in sizes_mb:
                body = json.dumps(case_body(door, prompt_text(size * 1_000_000))).encode()
                send_once(gateway, http, door, body)  # first use of the path, not counted
                samples = [send_once(gateway, http, door, body) for _ in range(repeats)]
                cpu = [sample["cpu_ms"] for sample in samples]
                cases.append(
                    {"door": door, "prompt_mb": size, "body_bytes": len(body),
                     "statuses": sorted({s["status"] for s in samples}),
                     "codes": sorted({str(s["code"]) for s in samples}),
                     "rejected": all(s["code"] == CODE for s in samples),
                     "cpu_ms_median": sorted(cpu)[len(cpu) // 2], "cpu_ms_max": max(cpu)}
                )  # fmt: skip
        num_log_lines = gateway.num_log_lines()
    return {
        "max_rejection_cpu_ms": max(case["cpu_ms_max"] for case in cases),
        "rejection_all_refused": all(case["rejected"] for case in cases),
        "rejection_cases": cases,
        "rejection_gateway_log_lines": num_log_lines,
    }
