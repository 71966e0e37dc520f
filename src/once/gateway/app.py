"""The gateway's FastAPI app: the Responses API over HTTP+SSE and WebSocket.

Every request goes through the same pipeline, in this order: bounded body (413) -> JSON
parse -> schema validation with the SDK's types -> semantic validation (400 naming the
param) -> preflight: API key (401), request rate limit (429 with retry-after) -> render
and tokenize -> token rate limit -> dispatch, with the input check started alongside.
Every failure is an OpenAI-style error body with a code; nothing reaches a 500.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from once.gateway.auth import KeyRing, Tenant
from once.gateway.capacity import LOAD_REPORT_HEADER, CpuCostMeter
from once.gateway.input_items import chain_items, page, parse_query
from once.gateway.metrics import GatewayMetrics
from once.gateway.ratelimit import RateLimiter
from once.gateway.responses import ResponsesService
from once.gateway.sse import sse_frame
from once.gateway.validation import check_semantics
from once.protocol.errors import (
    InvalidRequestError,
    OnceError,
    PayloadTooLargeError,
    RateLimitError,
    ResponseNotFoundError,
)
from once.protocol.responses import ResponsesRequest, parse_request

logger = logging.getLogger(__name__)


@dataclass
class Gateway:
    """Everything a request handler needs; built once by `cli.py` or a test."""

    service: ResponsesService
    keyring: KeyRing
    limiter: RateLimiter
    metrics: GatewayMetrics
    meter: CpuCostMeter
    max_body_bytes: int
    websocket_max_age_s: float

    async def admit(self, body: object, authorization: str | None, *, websocket=False):
        """Schema -> semantics -> key -> request limit. Returns (request, tenant)."""
        request = parse_request(body, websocket=websocket)
        check_semantics(request, self.service.models)
        tenant = self.keyring.authenticate(authorization)
        await self.limiter.hit_request(tenant)
        return request, tenant

    async def prepare(self, request: ResponsesRequest, tenant: Tenant, connection=None):
        prepared = await self.service.prepare(request, tenant, connection)
        await self.limiter.hit_tokens(tenant, len(prepared.built.prompt_ids))
        return prepared


def error_response(error: OnceError) -> JSONResponse:
    headers = {}
    if isinstance(error, RateLimitError):
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse({"error": error.to_dict()}, status_code=error.status, headers=headers)


def decode_json(body: bytes) -> object:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        error = InvalidRequestError(f"the body is not valid JSON: {e}")
        error.code = "invalid_json"
        raise error from None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"the body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def build_gateway_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="once gateway", docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    service, metrics = gateway.service, gateway.metrics

    @app.exception_handler(OnceError)
    async def once_error(_, error: OnceError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def routing_error(_, error: HTTPException):
        # Unknown paths and methods get the same error body as every other failure.
        failure = InvalidRequestError(str(error.detail))
        failure.status = error.status_code
        failure.code = {404: "not_found", 405: "method_not_allowed"}.get(
            error.status_code, failure.code
        )
        return error_response(failure)

    @app.exception_handler(Exception)
    async def unexpected(_, error: Exception):
        logger.exception("unexpected error in the gateway")
        return error_response(OnceError(f"internal error: {type(error).__name__}"))

    @app.post("/v1/responses")
    async def create_response(http: Request):
        body = await read_body(http, gateway.max_body_bytes)
        metrics.received_bytes.labels("http").inc(len(body))
        request, tenant = await gateway.admit(decode_json(body), http.headers.get("authorization"))
        if not request.generate:
            raise InvalidRequestError("generate=false is a WebSocket-mode field", param="generate")
        prepared = await gateway.prepare(request, tenant)
        inflight = int(metrics.inflight._value.get())
        headers = {LOAD_REPORT_HEADER: gateway.meter.load_report_header(inflight)}
        if request.stream:
            return StreamingResponse(
                _sse(gateway, prepared),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        final = None
        with metrics.inflight.track_inprogress():
            async for event in service.stream(prepared):
                final = event
        metrics.requests.labels("http", final["type"]).inc()
        gateway.meter.record("request", prepared.cpu_s, len(prepared.built.prompt_ids))
        response = final.get("response") or {}
        if response.get("status") == "failed":
            error = response.get("error") or {}
            failure = OnceError(error.get("message", "the response failed"))
            failure.code = error.get("code") or failure.code
            return error_response(failure)
        return JSONResponse(response, headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, http: Request):
        tenant = gateway.keyring.authenticate(http.headers.get("authorization"))
        record = await service.store.get(response_id, tenant.name)
        if record is None:
            raise ResponseNotFoundError(f"no response with id {response_id!r}", param="id")
        return JSONResponse(record.response)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, http: Request):
        tenant = gateway.keyring.authenticate(http.headers.get("authorization"))
        order, limit, after = parse_query(http.query_params)
        record = await service.store.get(response_id, tenant.name)
        if record is None:
            raise ResponseNotFoundError(f"no response with id {response_id!r}", param="id")
        items = await chain_items(service.store, record, tenant.name)
        return JSONResponse(page(items, order, limit, after))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, http: Request):
        tenant = gateway.keyring.authenticate(http.headers.get("authorization"))
        if not await service.store.delete(response_id, tenant.name):
            raise ResponseNotFoundError(f"no response with id {response_id!r}", param="id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/models")
    async def list_models():
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "once"}
            for name in service.models
        ]
        return {"object": "list", "data": data}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/v1/responses")
    async def websocket_mode(socket: WebSocket):
        from once.gateway.websocket import serve_connection

        await serve_connection(gateway, socket)

    return app


async def _sse(gateway: Gateway, prepared):
    metrics = gateway.metrics
    last = "error"
    with metrics.inflight.track_inprogress():
        try:
            async for batch in gateway.service.stream_batches(prepared):
                t0 = time.perf_counter()  # wall of a sync section: cheaper than thread_time
                chunk = b"".join(sse_frame(event) for event in batch)
                prepared.cpu_s += time.perf_counter() - t0
                last = batch[-1]["type"]
                yield chunk
        except asyncio.CancelledError:
            last = "disconnected"
            raise
        finally:
            metrics.requests.labels("http", last).inc()
            gateway.meter.record("request", prepared.cpu_s, len(prepared.built.prompt_ids))


def create_gateway(config, engine, models: dict, registry=None) -> Gateway:
    """Wire the gateway's own parts around an engine client and the served models."""
    from prometheus_client import CollectorRegistry

    from once.gateway.store import open_store

    registry = registry or CollectorRegistry()
    metrics = GatewayMetrics(registry)
    meter = CpuCostMeter(registry)
    service = ResponsesService(
        engine,
        models,
        open_store(config.store, config.store_ttl_s),
        metrics,
        verify_every=config.verify_every,
        stream_interval_s=config.stream_interval_s,
        on_cpu=lambda stage, cpu_s, tokens: meter.record(stage, cpu_s, tokens),
    )
    keyring = KeyRing.from_file(config.api_keys_file) if config.api_keys_file else KeyRing.open()
    return Gateway(
        service=service,
        keyring=keyring,
        limiter=RateLimiter(config.rate_limit_storage),
        metrics=metrics,
        meter=meter,
        max_body_bytes=config.max_body_bytes,
        websocket_max_age_s=config.websocket_max_age_s,
    )
