"""The constraint as data: its checks, its dict form, and the engine HTTP round trip (a
RemoteEngineClient against build_engine_app, over a real loopback server)."""

import json
import re

import pytest

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.scripted import ScriptedEngine
from once.engine.testing import byte_grammar_tokenizer
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app, parse_generate_request
from once.gateway.testing import serve_app
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams
from once.protocol.errors import InvalidRequestError

SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'


@pytest.mark.parametrize(
    ("kind", "text", "param"),
    [
        ("sql", "select 1", "constraint.kind"),
        ("regex", "", "constraint.text"),
        ("lark", "   ", "constraint.text"),
        ("json_schema", "{not json", "constraint.text"),
        ("json_schema", "[1, 2]", "constraint.text"),
        ("json_object", "{}", "constraint.text"),
        ("regex", 5, "constraint.text"),
    ],
)
def test_a_malformed_constraint_names_its_param(kind, text, param):
    with pytest.raises(InvalidRequestError) as caught:
        OutputConstraint(kind, text)
    assert caught.value.param == param


def test_the_constraint_round_trips_through_dicts_and_free_requests_stay_unchanged():
    constraint = OutputConstraint("json_schema", SCHEMA)
    request = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=5, constraint=constraint))
    data = request.to_dict()
    assert data["sampling"]["constraint"] == {"kind": "json_schema", "text": SCHEMA}
    assert GenerateRequest.from_dict(json.loads(json.dumps(data))) == request
    assert parse_generate_request(json.dumps(data).encode()) == request
    free = GenerateRequest("f", (1, 2)).to_dict()
    assert "constraint" not in free["sampling"]  # what servers without constraints accept
    assert GenerateRequest.from_dict(free).sampling.constraint is None
    with pytest.raises(InvalidRequestError):
        SamplingParams(constraint={"kind": "regex", "text": "a"})


async def test_the_scripted_engine_plays_its_script_whatever_the_constraint():
    engine = ScriptedEngine([[7, 8, 9]])
    constraint = OutputConstraint("regex", "[a-z]+")
    request = GenerateRequest("s", (1, 2), SamplingParams(max_tokens=5, constraint=constraint))
    async with serve_app(build_engine_app(engine, model_name="scripted")) as (url, _):
        async with RemoteEngineClient(url) as client:
            deltas = [d async for d in client.generate(request)]
    assert [t for d in deltas for t in d.token_ids] == [7, 8, 9]
    assert engine.requests[0].sampling.constraint == constraint  # arrived whole


async def test_the_engine_server_enforces_and_rejects_constraints(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64)
    engine = AsyncEngine(LLMEngine(config, grammar_tokenizer=byte_grammar_tokenizer()))
    try:
        async with serve_app(build_engine_app(engine, model_name="tiny")) as (url, _):
            async with RemoteEngineClient(url) as client:
                constraint = OutputConstraint("regex", "[0-9]{4}-[a-z]{4}")
                sampling = SamplingParams(
                    temperature=1.0, seed=5, max_tokens=16, constraint=constraint
                )
                deltas = [
                    d async for d in client.generate(GenerateRequest("ok", (40, 41), sampling))
                ]
                text = bytes(t for d in deltas for t in d.token_ids).decode("latin-1")
                assert (
                    re.fullmatch("[0-9]{4}-[a-z]{4}", text) and deltas[-1].finish_reason == "stop"
                )

                bad = SamplingParams(constraint=OutputConstraint("lark", "start: missing"))
                with pytest.raises(InvalidRequestError) as caught:
                    async for _ in client.generate(GenerateRequest("bad", (40, 41), bad)):
                        pass
                assert caught.value.param == "constraint.text"
                assert "missing" in caught.value.message
    finally:
        await engine.close()
