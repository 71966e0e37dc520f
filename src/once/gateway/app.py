"""The gateway's FastAPI app: its front ends around one response pipeline.

Every request goes through the pipeline (pipeline.py), in this order: bounded body (413,
or 408 when it is too slow to arrive: slow_clients.py) -> JSON parse -> schema validation
with the SDK's types -> semantic validation (400 naming the param) -> preflight: API key
(401), request rate limit (429 with retry-after) -> render and tokenize -> token rate
limit -> dispatch, with the input check started alongside.
Every failure is an OpenAI-style error body with a code; nothing reaches a 500.
"""

import logging

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from once.gateway.admission.auth import KeyRing
from once.gateway.admission.capacity import CpuCostMeter
from once.gateway.admission.ratelimit import RateLimiter
from once.gateway.aliases import ModelAliases
from once.gateway.apis.chat.http import chat_routes
from once.gateway.apis.messages.http import anthropic_error_response, messages_routes
from once.gateway.apis.responses.http import responses_routes
from once.gateway.apis.responses.websocket import serve_connection
from once.gateway.config import GatewayConfig
from once.gateway.front.door import FrontDoor
from once.gateway.front.http_io import error_response
from once.gateway.front.openapi import PathMethods, documented_routes, encoded_document
from once.gateway.front.slow_clients import BodyDeadline
from once.gateway.hosted.backends import HostedBackends
from once.gateway.hosted.base import HostedTools, ToolSearch
from once.gateway.hosted.mcp import RemoteMcp
from once.gateway.hosted.programs import ProgrammaticToolCalling
from once.gateway.metrics import GatewayMetrics
from once.gateway.model import ModelRuntime
from once.gateway.pipeline import GatewayParts, ResponsePipeline
from once.gateway.state.prefix_states import PrefixStates
from once.gateway.state.store import open_store
from once.protocol.engine import EngineClient
from once.protocol.errors import (
    InvalidRequestError,
    MethodNotAllowedError,
    OnceError,
    RouteNotFoundError,
)

logger = logging.getLogger(__name__)

ROUTING_ERRORS: dict[int, type[InvalidRequestError]] = {
    404: RouteNotFoundError,
    405: MethodNotAllowedError,
}


def build_gateway_app(pipeline: ResponsePipeline) -> FastAPI:
    app = FastAPI(title="once gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = pipeline
    parts = pipeline.parts
    door = FrontDoor.build(pipeline, parts, pipeline.config)
    app.add_middleware(
        BodyDeadline,
        timeout_s=door.body_timeout_s,
        on_timeout=door.metrics.client_timeouts.labels("body").inc,
    )

    def error_for(request: Request, error: OnceError, headers=None) -> Response:
        # Each API's own error shape: Anthropic's under /v1/messages, OpenAI's elsewhere.
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error_response(error, headers)
        return error_response(error, headers)

    @app.exception_handler(OnceError)
    async def once_error(request: Request, error: OnceError):
        return error_for(request, error)

    path_methods: list[PathMethods] = []  # filled once every route is in place

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, error: HTTPException):
        # Unknown paths and methods get the same error body as every other failure; a 405
        # lists every method of the path (Starlette's names only the first route's).
        failure = ROUTING_ERRORS.get(error.status_code, InvalidRequestError)(str(error.detail))
        headers = getattr(error, "headers", None)
        allowed = path_methods[0].allowed(request.url.path) if path_methods else []
        if error.status_code == 405 and allowed:
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return error_for(request, failure, headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unexpected error in the gateway")
        return error_for(request, OnceError(f"internal error: {type(error).__name__}"))

    app.include_router(responses_routes(door))
    app.include_router(chat_routes(door))
    app.include_router(messages_routes(door))

    @app.get("/v1/models")
    async def list_models():
        # The served models, each with the client names that reach it.
        aliases = parts.aliases.by_served()
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "once",
             "aliases": aliases.get(name, [])}
            for name in parts.models
        ]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(parts.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/v1/responses")
    async def websocket_mode(socket: WebSocket):
        await serve_connection(door, socket)

    # Built once, after every route is in place, and served as the same bytes each time.
    document = encoded_document(app, auth=parts.keyring.enabled, models=list(parts.models))
    path_methods.append(PathMethods(documented_routes(app)))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json():
        return Response(document, media_type="application/json")

    return app


def default_hosted_tools(backends: dict | None = None) -> HostedTools:
    """The hosted tools `once serve` runs: remote MCP servers, programs, server-side tool
    search (their order is the order their work before generation appears in a response)
    and the hosted tools the config's `hosted_backends` serve."""
    tools: list = [RemoteMcp(), ProgrammaticToolCalling(), ToolSearch()]
    if backends:
        tools.append(HostedBackends(backends))
    return HostedTools(tools)


def create_gateway(
    config: GatewayConfig,
    engine: EngineClient,
    models: dict[str, ModelRuntime],
    registry: CollectorRegistry | None = None,
    hosted: HostedTools | None = None,
) -> ResponsePipeline:
    """Wire the gateway's own parts around an engine client and the served models;
    `hosted`, the hosted tools, defaults to `default_hosted_tools()`."""
    registry = registry or CollectorRegistry()
    keyring = KeyRing.from_file(config.api_keys_file) if config.api_keys_file else KeyRing.open()
    store = open_store(
        config.store,
        config.store_ttl_s,
        max_bytes=config.store_max_bytes,
        redis_timeout_s=config.redis_timeout_s,
    )
    parts = GatewayParts(
        engine=engine,
        models=models,
        store=store,
        metrics=GatewayMetrics(registry),
        meter=CpuCostMeter(registry),
        keyring=keyring,
        limiter=RateLimiter(config.rate_limit_storage, redis_timeout_s=config.redis_timeout_s),
        aliases=ModelAliases(models, config.aliases),
        prefix_states=PrefixStates(config.stateless_states, config.stateless_tokens),
        hosted=default_hosted_tools(config.hosted_backends) if hosted is None else hosted,
    )
    return ResponsePipeline(config, parts)
