"""Logprobs as data: SamplingParams' check, the dict forms of requests and deltas (absent
unless set), the scripted engine's fakes, and the engine HTTP round trip (build_engine_app
and RemoteEngineClient over a real loopback server, around the tiny model)."""

import json

import pytest

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.scripted import ScriptedEngine, scripted_logprobs
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app, parse_generate_request
from once.gateway.testing import serve_app
from once.protocol.engine import GenerateRequest, SamplingParams, TokenDelta, TokenLogprob
from once.protocol.errors import InvalidRequestError


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "3"])
def test_logprobs_out_of_range_or_not_an_integer_names_its_param(value):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logprobs=value)
    assert caught.value.param == "logprobs"


@pytest.mark.parametrize("value", [True, "3", 2.0, [1]])
def test_the_server_refuses_logprobs_of_the_wrong_type(value):
    body = {"request_id": "r", "prompt_token_ids": [1], "sampling": {"logprobs": value}}
    with pytest.raises(InvalidRequestError) as caught:
        parse_generate_request(json.dumps(body).encode())
    assert caught.value.param == "sampling.logprobs"


def test_logprobs_round_trip_through_dicts_and_stay_out_of_requests_that_do_not_ask():
    request = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=5, logprobs=0))
    data = json.loads(json.dumps(request.to_dict()))
    assert data["sampling"]["logprobs"] == 0  # 0 is set: the sampled ids' own logprobs
    assert GenerateRequest.from_dict(data) == request
    assert parse_generate_request(json.dumps(data).encode()) == request
    plain = GenerateRequest("p", (1, 2)).to_dict()
    assert "logprobs" not in plain["sampling"]  # what servers without logprobs accept
    assert GenerateRequest.from_dict(plain).sampling.logprobs is None

    entries = [TokenLogprob(7, -0.25, ((7, -0.25), (9, -1.5))), TokenLogprob(3, -2.0)]
    delta = TokenDelta("r", [7, 3], logprobs=entries)
    wire = json.loads(json.dumps(delta.to_dict()))
    assert wire["logprobs"] == [
        {"token_id": 7, "logprob": -0.25, "top_logprobs": [[7, -0.25], [9, -1.5]]},
        {"token_id": 3, "logprob": -2.0, "top_logprobs": []},
    ]
    assert TokenDelta.from_dict(wire) == delta
    assert "logprobs" not in TokenDelta("r", [7]).to_dict()
    assert TokenDelta.from_dict(TokenDelta("r", [7]).to_dict()).logprobs is None


async def test_the_scripted_engine_fakes_logprobs_only_when_asked():
    engine = ScriptedEngine([[7, 8, 9], [7, 8, 9]], tokens_per_delta=2)
    asked = GenerateRequest("a", (1, 2), SamplingParams(max_tokens=5, logprobs=3))
    deltas = [d async for d in engine.generate(asked)]
    assert [d.logprobs for d in deltas] == [scripted_logprobs([7, 8], 3), scripted_logprobs([9], 3)]
    assert deltas[0].logprobs[1] == TokenLogprob(8, 0.0, ((8, 0.0), (9, -1.0), (10, -2.0)))
    plain = [d async for d in engine.generate(GenerateRequest("p", (1, 2)))]
    assert all(d.logprobs is None for d in plain)


async def test_logprobs_cross_the_engine_server_unchanged(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    requests = [
        GenerateRequest("lp", (40, 41, 42), sampling),
        GenerateRequest("plain", (40, 9), SamplingParams(max_tokens=6)),
    ]
    direct = LLMEngine(config).generate(requests)
    engine = AsyncEngine(LLMEngine(config))
    try:
        async with serve_app(build_engine_app(engine, model_name="tiny")) as (url, _):
            async with RemoteEngineClient(url) as client:
                for request in requests:
                    got = [d async for d in client.generate(request)]
                    want = direct[request.request_id]
                    assert [d.token_ids for d in got] == [d.token_ids for d in want]
                    # JSON floats round-trip exactly: the same values as in process.
                    assert [d.logprobs for d in got] == [d.logprobs for d in want]
    finally:
        await engine.close()
    assert all(d.logprobs for d in direct["lp"] if d.token_ids)
    assert all(d.logprobs is None for d in direct["plain"])
