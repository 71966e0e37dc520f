"""The handshake cost a persistent WebSocket removes: HTTPS per call vs one WSS connection.

A self-signed certificate (openssl, P-256) for 127.0.0.1; the gateway serves TLS around
the zero-latency scripted engine. Three clients send the same sequential calls:
a new HTTPS connection per call (TCP + TLS handshake each time), one keep-alive HTTPS
connection, and one WSS connection with `response.create` frames.
"""

import asyncio
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets

from once.bench.gateway_bench.load_client import prompt_text
from once.bench.gateway_bench.overhead import free_port, wait_until_healthy
from once.bench.gateway_bench.scripted_server import MODEL


def make_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _body(i: int) -> dict:
    return {"model": MODEL, "input": prompt_text(i), "store": False}


def _per_call_ms(durations: list[float]) -> float:
    return 1000 * statistics.median(durations)


def https_new_connection(url: str, context: ssl.SSLContext, calls: int) -> list[float]:
    durations = []
    for i in range(calls):
        start = time.perf_counter()
        with httpx.Client(verify=context, timeout=30) as client:
            client.post(url + "/v1/responses", json=_body(i)).raise_for_status()
        durations.append(time.perf_counter() - start)
    return durations


def https_keep_alive(url: str, context: ssl.SSLContext, calls: int) -> list[float]:
    durations = []
    with httpx.Client(verify=context, timeout=30) as client:
        client.post(url + "/v1/responses", json=_body(-1)).raise_for_status()
        for i in range(calls):
            start = time.perf_counter()
            client.post(url + "/v1/responses", json=_body(i)).raise_for_status()
            durations.append(time.perf_counter() - start)
    return durations


async def wss_persistent(url: str, context: ssl.SSLContext, calls: int) -> list[float]:
    durations = []
    async with websockets.connect(url + "/v1/responses", ssl=context, max_size=2**24) as ws:
        for i in range(-1, calls):
            start = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create", **_body(i)}))
            while True:
                event = json.loads(await ws.recv())
                if event["type"] in ("response.completed", "response.incomplete", "error"):
                    break
            if i >= 0:
                durations.append(time.perf_counter() - start)
    return durations


def run(calls: int = 30) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_certificate(Path(tmp))
        context = ssl.create_default_context(cafile=str(cert))
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "once.bench.gateway_bench.scripted_server",
             "--mode", "gateway", "--port", str(port),
             "--tls-certfile", str(cert), "--tls-keyfile", str(key)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        url = f"https://127.0.0.1:{port}"
        try:
            wait_until_healthy(server, url, "TLS gateway", verify=context)
            new_connection = https_new_connection(url, context, calls)
            keep_alive = https_keep_alive(url, context, calls)
            persistent = asyncio.run(wss_persistent(f"wss://127.0.0.1:{port}", context, calls))
        finally:
            server.terminate()
            server.wait(10)
    return {
        "calls": calls,
        "https_new_connection_ms_per_call": _per_call_ms(new_connection),
        "https_keep_alive_ms_per_call": _per_call_ms(keep_alive),
        "wss_persistent_ms_per_call": _per_call_ms(persistent),
        "handshake_ms_saved_per_call": _per_call_ms(new_connection) - _per_call_ms(persistent),
    }
