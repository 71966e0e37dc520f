"""A client that stops reading mid-stream, and slowloris clients.

A gateway (in process, scripted engine) with short client deadlines: a write must be
taken within `SEND_TIMEOUT_S`, a body must arrive within `BODY_TIMEOUT_S`. Its listening
socket has a small send buffer, so a reader that stops fills the few buffers between the
engine and it (kernel, uvicorn's 64 KiB write buffer) within a second. Raw sockets play
the bad clients. What must hold:

- the slow readers (a long stream over SSE and one over a WebSocket, each client's
  receive buffer small, read once and then never): the write blocks, the deadline
  passes, the stream ends and its engine request is aborted (finish "abort", long before
  its output could have finished), counted;
- slowloris: clients that never finish their headers hold only their sockets; one that
  trickles its body gets a 408 `request_timeout` once the body deadline passes, counted;
- meanwhile other clients' streams complete, whole and exact.
"""

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import time

import httpx

from once.bench.reliability.fault_kit import (
    FaultContext,
    FaultResult,
    final_response,
    output_text,
    stream_response,
)
from once.gateway.config import GatewayConfig
from once.gateway.testing import DEFAULT_MODEL, serve_gateway
from once.protocol.scripted_engine import ScriptedEngine

SEND_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.0
SERVER_SEND_BUFFER_BYTES = 4096  # the kernel doubles it
CLIENT_RECEIVE_BUFFER_BYTES = 4096
# The slow readers' max_output_tokens, which the script answers with this many tokens of
# 80 characters each: at 8 tokens every 8 ms, 8 s if it were never aborted.
NUM_LONG_TOKENS = 8000
NUM_HEADER_SLOWLORIS = 8
NUM_OTHER_STREAMS = 3
WAIT_S = 30.0  # hang guard
SHORT_TEXT = "A short answer, whole."
_RESPONSE_ID = re.compile(rb'"id":"(resp_[A-Za-z0-9]+)"')
_TIMED_OUT = re.compile(rb"HTTP/1.1 (\d+).*?request_timeout", re.S)


def _engine(runtime) -> ScriptedEngine:
    eos = runtime.tokenizer.eos_token_id
    short = runtime.builder.encode(SHORT_TEXT) + [eos]
    rule = runtime.builder.encode("#" * 80)
    long = (rule * NUM_LONG_TOKENS)[:NUM_LONG_TOKENS]

    def script(request):
        return long if request.sampling.max_tokens == NUM_LONG_TOKENS else short

    return ScriptedEngine(script, eos_token_id=eos, token_latency_s=0.001, tokens_per_delta=8)


def _post(path: str, body: bytes, *, send_bytes: int | None = None) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + (body if send_bytes is None else body[:send_bytes])


async def _connect(port: int, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before connect, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


def _websocket_handshake() -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        "GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def _websocket_text_frame(payload: bytes) -> bytes:
    # RFC 6455: FIN + text opcode, the mask bit and a 7- or 16-bit length, the masking key.
    mask = os.urandom(4)
    size = len(payload)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))
    return bytes([0x81]) + length + mask + masked


async def _start_slow_reader(port: int, websocket: bool) -> tuple[socket.socket, str]:
    """A client asking for a long stream, its receive buffer small, that reads up to its
    response's id and then never again: the socket and that id."""
    loop = asyncio.get_running_loop()
    sock = await _connect(port, CLIENT_RECEIVE_BUFFER_BYTES)
    body = {"model": DEFAULT_MODEL, "input": "go on", "max_output_tokens": NUM_LONG_TOKENS}
    if websocket:
        await loop.sock_sendall(sock, _websocket_handshake())
        await _recv_until(sock, re.compile(rb"HTTP/1.1 101.*?\r\n\r\n", re.S))
        frame = json.dumps({"type": "response.create", **body}).encode()
        await loop.sock_sendall(sock, _websocket_text_frame(frame))
    else:
        payload = json.dumps({**body, "stream": True}).encode()
        await loop.sock_sendall(sock, _post("/v1/responses", payload))
    return sock, (await _recv_until(sock, _RESPONSE_ID)).group(1).decode()


async def _recv_until(sock: socket.socket, pattern: re.Pattern[bytes]) -> re.Match[bytes]:
    loop, seen = asyncio.get_running_loop(), b""
    async with asyncio.timeout(WAIT_S):
        while (match := pattern.search(seen)) is None:
            chunk = await loop.sock_recv(sock, 2048)
            if not chunk:
                raise ConnectionError(f"closed after {seen[:200]!r}")
            seen += chunk
    return match


async def _wait_for(condition, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > WAIT_S:
            raise TimeoutError(f"waited {WAIT_S:.0f} s for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def slow_reader_and_slowloris(context: FaultContext) -> FaultResult:
    runtime = context.runtime
    engine = _engine(runtime)
    config = GatewayConfig(
        store="memory", send_timeout_s=SEND_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S
    )
    sockets: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    serving = serve_gateway(runtime, engine, config, send_buffer_bytes=SERVER_SEND_BUFFER_BYTES)
    async with serving as (url, gateway), httpx.AsyncClient(timeout=WAIT_S) as http:
        port = int(url.rsplit(":", 1)[1])
        try:
            # The slow readers, over SSE and over a WebSocket.
            slow_ids = []
            for websocket in (False, True):
                sock, response_id = await _start_slow_reader(port, websocket)
                sockets.append(sock)
                slow_ids.append(response_id)
            stopped_reading = time.monotonic()
            # Slowloris: headers never finished, and a body trickled.
            for _ in range(NUM_HEADER_SLOWLORIS):
                sock = await _connect(port)
                sockets.append(sock)
                await loop.sock_sendall(sock, b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            trickle = await _connect(port)
            sockets.append(trickle)
            whole = json.dumps({"model": DEFAULT_MODEL, "input": "x" * 2000}).encode()
            await loop.sock_sendall(trickle, _post("/v1/responses", whole, send_bytes=10))
            # Meanwhile, other clients.
            others = await asyncio.gather(
                *(
                    stream_response(http, url, {"model": DEFAULT_MODEL, "input": f"hi {i}"})
                    for i in range(NUM_OTHER_STREAMS)
                )
            )
            status = await _recv_until(trickle, _TIMED_OUT)
            await _wait_for(
                lambda: all(i in engine.finish_reasons for i in slow_ids),
                "the slow readers' engine requests",
            )
            seconds_to_abort = time.monotonic() - stopped_reading
            metrics = gateway.metrics
            send_timeouts = metrics.value(metrics.client_timeouts, "send")
            body_timeouts = metrics.value(metrics.client_timeouts, "body")
            num_generated = (await engine.stats())["num_generated_tokens"]
        finally:
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    finals = [final_response(events) or {} for events in others]
    other_tokens = sum((f.get("usage") or {}).get("output_tokens", 0) for f in finals)
    others_whole = all(
        f.get("status") == "completed" and output_text(f) == SHORT_TEXT for f in finals
    )
    checks = {
        "the SSE slow reader's engine request is aborted": engine.finish_reasons.get(slow_ids[0])
        == "abort",
        "the WebSocket slow reader's engine request is aborted": engine.finish_reasons.get(
            slow_ids[1]
        )
        == "abort",
        "the send deadlines are counted": send_timeouts == 2,
        "a trickled body gets 408 request_timeout": status.group(1) == b"408",
        "the body deadline is counted": body_timeouts == 1,
        "other streams complete whole while the bad clients hang on": others_whole,
    }
    return FaultResult(
        "slow_clients",
        checks,
        sessions_lost=NUM_OTHER_STREAMS - sum(f.get("status") == "completed" for f in finals),
        detail={
            "send_timeout_s": SEND_TIMEOUT_S,
            "body_timeout_s": BODY_TIMEOUT_S,
            "seconds_from_last_read_to_both_engine_aborts": round(seconds_to_abort, 2),
            "slow_readers_tokens_generated_of": [num_generated - other_tokens, 2 * NUM_LONG_TOKENS],
            "header_slowloris_connections_held": NUM_HEADER_SLOWLORIS,
            "other_streams_completed": sum(f.get("status") == "completed" for f in finals),
        },
    )
