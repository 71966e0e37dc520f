"""The engine server and RemoteEngineClient, over a real uvicorn on a free local port."""

import asyncio
import contextlib
import socket

import httpx
import pytest

from once.engine.scripted import ScriptedEngine
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app
from once.gateway.testing import serve_app
from once.protocol.engine import GenerateRequest, SamplingParams, TokenDelta
from once.protocol.errors import ContextLengthExceededError, EngineDeadError, OnceError

TIMEOUT_S = 5


@contextlib.asynccontextmanager
async def serve(engine):
    """Run the engine app on 127.0.0.1 with an OS-chosen port; yield its base URL."""
    async with serve_app(build_engine_app(engine, model_name="scripted")) as (url, _):
        yield url


@pytest.fixture
async def remote():
    """(engine, client, raw httpx client) around a fresh server per test."""

    @contextlib.asynccontextmanager
    async def start(engine):
        async with serve(engine) as base_url:
            async with (
                RemoteEngineClient(base_url) as client,
                httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT_S) as http,
            ):
                yield client, http

    return start


def make_request(request_id="r1", prompt=(1, 2, 3), **kwargs) -> GenerateRequest:
    sampling = SamplingParams(**kwargs.pop("sampling", {}))
    return GenerateRequest(request_id, tuple(prompt), sampling=sampling, **kwargs)


async def collect(client, request) -> list[TokenDelta]:
    async def run():
        return [delta async for delta in client.generate(request)]

    return await asyncio.wait_for(run(), timeout=TIMEOUT_S)


def comparable(delta: TokenDelta) -> tuple:
    counts = None
    if delta.metrics is not None:
        m = delta.metrics
        counts = (m.num_prompt_tokens, m.num_cached_tokens, m.num_computed_tokens)
        counts += (m.num_output_tokens,)
    return (delta.request_id, delta.token_ids, delta.finish_reason, delta.num_cached_tokens, counts)


async def test_remote_streams_the_same_deltas_as_the_engine(remote):
    script = [[7, 8, 9, 0, 5], [4, 4]]
    direct = ScriptedEngine(script, eos_token_id=0, block_size=2)
    served = ScriptedEngine(script, eos_token_id=0, block_size=2)
    prompt = list(range(1, 8))
    async with remote(served) as (client, _):
        for request in (make_request("a", prompt), make_request("b", prompt + [9])):
            expected = [comparable(d) for d in await collect(direct, request)]
            got = [comparable(d) for d in await collect(client, request)]
            assert got == expected
        assert got[0][3] == 6  # the second request hit the prefix cache over HTTP
        assert await client.stats() == {**await direct.stats(), "prefix_cache_hit_rate": 6 / 15}
        assert await client.models() == ["scripted"]
        await client.check_health()


async def test_context_length_error_keeps_its_class_and_status(remote):
    async with remote(ScriptedEngine(max_model_len=4)) as (client, http):
        with pytest.raises(ContextLengthExceededError) as info:
            await collect(client, make_request(prompt=range(1, 10)))
        assert info.value.code == "context_length_exceeded"
        response = await http.post("/v1/generate", json=make_request(prompt=range(1, 10)).to_dict())
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"


MALFORMED_BODIES = [
    b"not json",
    b"[1, 2]",
    b'{"request_id": "x", "prompt_token_ids": "abc"}',
    b'{"request_id": "x", "prompt_token_ids": [1, true]}',
    b'{"request_id": "x", "prompt_token_ids": []}',
    b'{"request_id": 5, "prompt_token_ids": [1]}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"max_tokens": "5"}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"max_tokens": 0}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"temperature": true}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"bogus": 1}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": []}',
    b'{"request_id": "x", "prompt_token_ids": [1], "forced_output_ids": [-1.5]}',
    b'{"request_id": "x", "prompt_token_ids": [1], "cache_salt": 3}',
    b'{"request_id": "x", "prompt_token_ids": [1], "extra": 1}',
    b'{"request_id": "x", "prompt_token_ids": [1], "kv_transfer_params": "tcp://x"}',
    b'{"request_id": "x", "prompt_token_ids": [1], "kv_transfer_params": [1]}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"constraint": "regex"}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"constraint": {"kind": 1}}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"constraint": {"kind": "sql"}}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"constraint": {"kind": "regex"}}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": '
    b'{"constraint": {"kind": "json_schema", "text": "{nope"}}}',
    b'{"request_id": "x", "prompt_token_ids": [1], "sampling": '
    b'{"constraint": {"kind": "regex", "text": "a", "flags": "i"}}}',
]


async def test_malformed_bodies_are_400_invalid_request(remote):
    async with remote(ScriptedEngine()) as (_, http):
        for body in MALFORMED_BODIES:
            response = await http.post("/v1/generate", content=body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["code"] == "invalid_request", body


async def test_abort_endpoint(remote):
    engine = ScriptedEngine([list(range(100))], token_latency_s=0.05)
    async with remote(engine) as (client, http):
        await client.abort("never-seen")  # unknown ids are a no-op, not a 404
        response = await http.post("/v1/abort", content=b'{"request_id": 1}')
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_request"

        deltas = []
        async for delta in client.generate(make_request("slow")):
            deltas.append(delta)
            if len(deltas) == 1:
                await client.abort("slow")
        assert deltas[-1].finish_reason == "abort"
        assert len(deltas) < 10


class AbortRecordingEngine(ScriptedEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborted_ids: list[str] = []

    async def abort(self, request_id):
        self.aborted_ids.append(request_id)
        await super().abort(request_id)


async def test_client_disconnect_aborts_the_request(remote):
    engine = AbortRecordingEngine([list(range(1000))], token_latency_s=0.02)
    async with remote(engine) as (client, _):
        stream = client.generate(make_request("gone"))
        await asyncio.wait_for(anext(stream), TIMEOUT_S)
        await asyncio.wait_for(anext(stream), TIMEOUT_S)
        await stream.aclose()
        async with asyncio.timeout(TIMEOUT_S):
            while engine.finish_reasons.get("gone") != "abort":
                await asyncio.sleep(0.01)
        stats = await client.stats()
        assert stats["num_running"] == 0 and stats["num_requests_aborted"] == 1
        assert stats["num_generated_tokens"] < 100
        # The server called abort() itself: a real engine does not see generator closes.
        assert engine.aborted_ids == ["gone"]


class FailingEngine(ScriptedEngine):
    """Fails before the first delta (request id "early") or after it (any other id)."""

    async def generate(self, request):
        if request.request_id == "early":
            raise RuntimeError("boom")
        yield TokenDelta(request.request_id, [1], num_cached_tokens=0)
        raise ContextLengthExceededError("ran out of room")


async def test_engine_failures_become_error_bodies_and_error_deltas(remote):
    async with remote(FailingEngine()) as (client, http):
        response = await http.post("/v1/generate", json=make_request("early").to_dict())
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "server_error"
        with pytest.raises(OnceError, match="boom"):
            await collect(client, make_request("early"))

        deltas = await collect(client, make_request("late"))
        assert [d.finish_reason for d in deltas] == [None, "error"]
        assert deltas[-1].error["code"] == "context_length_exceeded"


async def test_metrics_health_and_two_apps_in_one_process(remote):
    engine = ScriptedEngine([[1, 2, 3]], ttft_s=0.01)
    async with remote(engine) as (client, http):
        await collect(client, make_request())
        text = (await http.get("/metrics")).text
        assert "once_engine_num_running_requests 0.0" in text
        assert "once_engine_generated_tokens_total 3.0" in text
        assert "once_engine_prompt_tokens_total 3.0" in text
        assert "once_engine_prefix_cache_hit_rate 0.0" in text
        assert "once_engine_kv_blocks_used" in text
        assert "once_engine_request_ttft_seconds_count 1.0" in text
        assert 'once_engine_http_requests_finished_total{finish_reason="length"} 1.0' in text
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        # A second app in the same process has its own registry.
        async with remote(ScriptedEngine()) as (_, other_http):
            other = (await other_http.get("/metrics")).text
            assert "once_engine_request_ttft_seconds_count 0.0" in other


async def test_unreachable_engine_is_engine_dead():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the client connects
    async with RemoteEngineClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(EngineDeadError, match="cannot connect") as info:
            await collect(client, make_request())
        assert info.value.code == "engine_unavailable"
        with pytest.raises(EngineDeadError):
            await client.stats()


def test_stats_collector_maps_known_keys_and_exports_unknown_numbers():
    from once.engine_http.metrics import EngineMetrics

    text = (
        EngineMetrics()
        .render(
            {"num_kv_blocks_used": 3, "num_steps": 7, "model": "m", "spec": {"k": 2}, "x.y": True}
        )
        .decode()
    )
    assert "once_engine_kv_blocks_used 3.0" in text
    assert "# TYPE once_engine_steps_total counter" in text
    assert "once_engine_spec_k 2.0" in text and "once_engine_x_y 1.0" in text
    assert "model" not in text.replace("once_engine", "")


async def test_pause_endpoint_passes_hints_on_and_names_the_bad_param(remote):
    engine = ScriptedEngine([[1]])
    async with remote(engine) as (client, http):
        await client.pause_session("session-1", 2.5)
        assert engine.pauses == [("session-1", 2.5)]
        bad_bodies = {
            b'{"session_key": "", "expected_s": 1}': "session_key",
            b'{"session_key": "s", "expected_s": -1}': "expected_s",
            b'{"session_key": "s", "expected_s": true}': "expected_s",
            b'{"session_key": "s"}': "expected_s",
        }
        for body, param in bad_bodies.items():
            response = await http.post("/v1/pause", content=body)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == param
        assert (await http.post("/v1/pause", content=b"[1]")).status_code == 400
        assert len(engine.pauses) == 1
