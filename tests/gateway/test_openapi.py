"""The gateway's OpenAPI contract: what `/openapi.json` documents, and schemathesis
fuzzing the real gateway (a ScriptedEngine behind it, in process over ASGI) against it.

The run is schemathesis's own (its engine, as `schemathesis run` drives it: the examples,
coverage and fuzzing phases over every operation, positive and negative data), bounded (a
few dozen fuzzed cases per operation and phase) and deterministic (a fixed seed, so the
same cases every run). Its checks: nothing answers 5xx; every status, content type and
body (each SSE event too) is documented and conforms; documented headers are there; an
undocumented method gets a 405 whose `Allow` lists the path's methods.
"""

import json

import httpx
import schemathesis
from hypothesis import strategies as st
from schemathesis.engine import events, from_schema

from once.gateway.app import build_gateway_app, create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.front.openapi import OPERATIONS, documented_routes
from once.gateway.testing import cycling_texts, offline_hosted
from tests.gateway.conftest import MODEL

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "unsupported_method",
    "allow_header_conformance",
)
CONFIG = GatewayConfig(store="memory", verify_every=1)
CASES_PER_OPERATION = 25
SCHEMATHESIS = {
    "seed": 0,
    "generation": {"mode": "all", "deterministic": True, "max-examples": CASES_PER_OPERATION},
    # The coverage phase enumerates ~47k boundary cases over these bodies (minutes): it is
    # run by hand (`phases.coverage`), not in the suite.
    "phases": {"stateful": {"enabled": False}, "coverage": {"enabled": False}},
    "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
}
MAX_FAILURES_SHOWN = 10


def gateway_app(runtime, config: GatewayConfig = CONFIG):
    engine = cycling_texts(runtime)
    gateway = create_gateway(config, engine, {runtime.name: runtime}, hosted=offline_hosted())
    return build_gateway_app(gateway)


def served_model_bodies(context, body):
    """Half the generated bodies name the served model, so they get past model lookup."""
    if isinstance(body, dict) and "model" in body:
        return st.sampled_from([body, {**body, "model": MODEL}])
    return st.just(body)


def run_schemathesis(schema) -> tuple[int, list[str]]:
    """Schemathesis's run over `schema`: (cases sent, each failed check with its curl)."""
    num_cases, failures = 0, []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            num_cases += len(recorder.interactions)
            for checks in recorder.checks.values():
                for check in checks:
                    if check.failure_info is not None:
                        failure, curl = check.failure_info.failure, check.failure_info.code_sample
                        failures.append(
                            f"{recorder.label}: {failure.title}\n{failure.message}\n{curl}"
                        )
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(f"schemathesis error: {event}")
    return num_cases, failures


def test_the_gateway_keeps_its_openapi_contract(runtime):
    config = schemathesis.Config.from_dict(SCHEMATHESIS)
    schema = schemathesis.openapi.from_asgi("/openapi.json", gateway_app(runtime), config=config)
    schema.hook("flatmap_body")(served_model_bodies)
    num_cases, failures = run_schemathesis(schema)
    assert num_cases >= 10 * len(OPERATIONS)
    unique = sorted(set(failures))
    assert not unique, f"{len(unique)} failures:\n\n" + "\n\n".join(unique[:MAX_FAILURES_SHOWN])


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


# -- the document agrees with the server (issue 33) --------------------------------------------

CHAT_USER = [{"role": "user", "content": "hi"}]
AGREEMENT_CASES = [  # (path, the body's component, body): the document and the server agree
    ("/v1/chat/completions", "CompletionCreateParamsBase", {"messages": []}),
    ("/v1/messages", "MessageCreateParamsBase", {"messages": [], "max_tokens": 5}),
    ("/v1/messages/count_tokens", "MessageCountTokensRequest", {"messages": []}),
    ("/v1/chat/completions", "CompletionCreateParamsBase", {"messages": CHAT_USER, "top_p": 0}),
    ("/v1/responses", "ResponseCreateParamsBase", {"input": "hi", "top_p": 0}),
    ("/v1/responses", "ResponseCreateParamsBase", {"input": "hi", "temperature": 2.5}),
    ("/v1/chat/completions", "CompletionCreateParamsBase", {"messages": CHAT_USER, "top_p": 0.5}),
    ("/v1/responses", "ResponseCreateParamsBase", {"input": "hi", "top_p": 1}),
    ("/v1/messages/count_tokens", "MessageCountTokensRequest", {"messages": CHAT_USER}),
]


async def test_the_document_and_the_server_agree_on_bounds(runtime):
    from jsonschema import Draft202012Validator

    app = gateway_app(runtime)
    document = await openapi_of(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        for path, component, body in AGREEMENT_CASES:
            body = {"model": MODEL, **body}
            schema = {"$ref": f"#/components/schemas/{component}", **document}
            documented = Draft202012Validator(schema).is_valid(body)
            reply = await client.post(path, json=body)
            assert reply.status_code in (200, 400), reply.text
            assert documented == (reply.status_code == 200), (path, body, reply.text)


async def test_count_tokens_takes_no_stream_in_the_document_or_the_server(runtime):
    app = gateway_app(runtime)
    document = await openapi_of(app)
    assert (
        "stream" not in document["components"]["schemas"]["MessageCountTokensRequest"]["properties"]
    )
    assert "stream" in document["components"]["schemas"]["MessageCreateParamsBase"]["properties"]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        body = {"model": MODEL, "messages": CHAT_USER, "stream": True}
        reply = await client.post("/v1/messages/count_tokens", json=body)
    assert reply.status_code == 400 and "stream" in reply.json()["error"]["message"]
