"""Codex CLI's idle timer against a long prefill (issue 31), with the real binary.

Codex drops a stream that sends nothing it counts for `stream_idle_timeout_ms` ("idle
timeout waiting for SSE"). Shrunk here to 2 s, against an engine whose first token takes
6 s: with the gateway's keep-alives (every 0.5 s) Codex finishes over HTTP and WebSocket;
without them it fails as it did on a 14k-token prefill on a busy machine.
"""

from dataclasses import replace

import pytest

from once.bench.clients.node_clients import run_codex
from once.bench.clients.scripted import MAX_MODEL_LEN
from once.gateway.config import GatewayConfig
from once.gateway.testing import serve_gateway
from once.protocol.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.clients

IDLE_TIMEOUT = {"stream_idle_timeout_ms": 2000, "stream_max_retries": 0, "request_max_retries": 0}
TTFT_S = 6.0


@pytest.fixture
def long_runtime(runtime):
    return replace(runtime, max_model_len=MAX_MODEL_LEN)  # Codex's prompt: ~14k tokens


def slow_engine(runtime) -> ScriptedEngine:
    eos = runtime.tokenizer.eos_token_id
    answer = runtime.builder.encode("Done.") + [eos]
    return ScriptedEngine(
        lambda request: answer, eos_token_id=eos, max_model_len=MAX_MODEL_LEN, ttft_s=TTFT_S
    )


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_codex_outlasts_a_long_prefill_with_keep_alives(long_runtime, tmp_path, websocket):
    config = GatewayConfig(store="memory", keep_alive_s=0.5)
    async with serve_gateway(long_runtime, slow_engine(long_runtime), config) as (url, _):
        run = await run_codex(
            url, tmp_path, "Say done.", websocket=websocket, provider_options=IDLE_TIMEOUT
        )
    assert run.returncode == 0 and "idle timeout" not in run.stderr + run.stdout, run
    assert "Done." in run.stdout, run


async def test_without_keep_alives_codex_idles_out(long_runtime, tmp_path):
    config = GatewayConfig(store="memory", keep_alive_s=0)
    async with serve_gateway(long_runtime, slow_engine(long_runtime), config) as (url, _):
        run = await run_codex(url, tmp_path, "Say done.", provider_options=IDLE_TIMEOUT)
    assert "idle timeout waiting for SSE" in run.stderr + run.stdout, run
