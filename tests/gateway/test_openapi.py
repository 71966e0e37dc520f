"""The gateway's OpenAPI contract: what `/openapi.json` documents, and schemathesis
fuzzing the real gateway (a ScriptedEngine behind it, in process over ASGI) against it.

The schemathesis run is bounded (a few dozen cases per operation, derandomized, so the
same cases every run) and checks that nothing answers 5xx, every status and content type
is documented, every body (SSE events included) conforms to its schema, documented
headers are there (`Allow` on 405s), and an undocumented method gets a 405.
"""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from once.gateway.app import build_gateway_app, create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.openapi import OPERATIONS, documented_routes
from once.gateway.testing import cycling_texts, offline_hosted
from tests.gateway.conftest import MODEL

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    unsupported_method,
]
CONFIG = GatewayConfig(store="memory", verify_every=1)
CASES_PER_OPERATION = 25
SCHEMATHESIS = schemathesis.Config.from_dict(
    {
        "seed": 0,
        "generation": {"mode": "all", "deterministic": True, "max-examples": CASES_PER_OPERATION},
        "phases": {"stateful": {"enabled": False}},
    }
)


def gateway_app(runtime, config: GatewayConfig = CONFIG):
    engine = cycling_texts(runtime)
    gateway = create_gateway(config, engine, {runtime.name: runtime}, hosted=offline_hosted())
    return build_gateway_app(gateway)


def served_model_bodies(context, body):
    """Half the generated bodies name the served model, so they get past model lookup."""
    if isinstance(body, dict) and "model" in body:
        return st.sampled_from([body, {**body, "model": MODEL}])
    return st.just(body)


@pytest.fixture(scope="module")
def gateway_schema(runtime):
    schema = schemathesis.openapi.from_asgi(
        "/openapi.json", gateway_app(runtime), config=SCHEMATHESIS
    )
    schema.hook("flatmap_body")(served_model_bodies)
    return schema


contract = schemathesis.pytest.from_fixture("gateway_schema")


@contract.parametrize()
@settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_the_gateway_keeps_its_openapi_contract(case):
    case.call_and_validate(checks=CHECKS)


# -- the document itself ---------------------------------------------------------------------


async def openapi_of(app) -> dict:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_every_route_has_a_row_in_the_table(runtime):
    assert set(documented_routes(gateway_app(runtime))) == set(OPERATIONS)


async def test_every_post_documents_its_body_and_every_route_its_errors(runtime):
    document = await openapi_of(gateway_app(runtime))
    schemas = document["components"]["schemas"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "200" in responses and "405" in responses, (method, path)
            assert "allow" in responses["405"]["headers"]
            if method == "post":
                body = operation["requestBody"]["content"]["application/json"]
                name = body["schema"]["$ref"].rsplit("/", 1)[1]
                assert schemas[name] and body["example"]["model"] == MODEL
                assert {"400", "413", "429"} <= set(responses), path
    streams = document["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert set(streams) == {"application/json", "text/event-stream"}
    anthropic = document["paths"]["/v1/messages"]["post"]["responses"]["400"]
    assert anthropic["content"]["application/json"]["schema"]["$ref"].endswith("AnthropicError")


async def test_the_request_schemas_are_the_sdk_types(runtime):
    document = await openapi_of(gateway_app(runtime))
    schemas = document["components"]["schemas"]
    # The Responses body: the SDK's create params, plus the fields this server requires.
    responses = schemas["ResponseCreateParamsBase"]
    assert {"model", "input"} <= set(responses["required"])
    assert {"tools", "tool_choice", "previous_response_id", "stream"} <= set(
        responses["properties"]
    )
    assert schemas["MessageCreateParamsBase"]["required"] == ["max_tokens", "messages", "model"]
    assert "max_tokens" not in schemas["MessageCountTokensRequest"]["required"]
    assert set(schemas["CompletionCreateParamsBase"]["required"]) == {"messages", "model"}


async def test_security_is_declared_only_when_the_gateway_checks_keys(runtime, tmp_path):
    open_document = await openapi_of(gateway_app(runtime))
    assert "securitySchemes" not in open_document["components"]
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-contract-test"\ntenant = "acme"\n')
    config = GatewayConfig(store="memory", api_keys_file=str(keys))
    document = await openapi_of(gateway_app(runtime, config))
    assert set(document["components"]["securitySchemes"]) == {"bearer", "x-api-key"}
    create = document["paths"]["/v1/responses"]["post"]
    assert create["security"] == [{"bearer": []}] and "401" in create["responses"]
    assert "security" not in document["paths"]["/healthz"]["get"]


async def test_the_document_is_the_same_bytes_every_time(runtime):
    transport = httpx.ASGITransport(app=gateway_app(runtime))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        first, second = [await client.get("/openapi.json") for _ in range(2)]
    assert first.content == second.content
    assert json.loads(first.content)["openapi"] == "3.1.0"


async def test_a_405_under_messages_names_the_allowed_methods(runtime):
    transport = httpx.ASGITransport(app=gateway_app(runtime))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/v1/messages")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["type"] == "error"
