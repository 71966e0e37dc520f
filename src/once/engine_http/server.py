"""HTTP front of `once engine`: token ids in, streamed token ids out.

Endpoints (all JSON unless noted):

    POST /v1/generate   GenerateRequest.to_dict() -> NDJSON stream, one TokenDelta.to_dict()
                        per line (`application/x-ndjson`; NDJSON rather than SSE because
                        the only reader is RemoteEngineClient, and a line is one delta).
    POST /v1/abort      {"request_id": ...} -> {"request_id": ..., "aborted": true}.
                        Unknown or finished ids are not an error (an abort races with the
                        request's own finish); an engine that raises RequestNotFoundError
                        gets a 404 `request_not_found`.
    GET  /v1/stats      engine.stats()
    GET  /v1/models     OpenAI-style model list with one entry
    GET  /healthz       {"status": "ok"}; if the engine has check_health() (sync or async)
                        and it raises an OnceError, that error (EngineDeadError: 503)
    GET  /metrics       Prometheus text (per-app registry; see metrics.py)

Errors before the first delta are a JSON body `{"error": err.to_dict()}` with err.status
(and `retry-after` when the engine is overloaded);
malformed JSON or wrong field types are 400 `invalid_request`. An error after the stream
started becomes a last delta with finish_reason "error" and the error dict. When the client
disconnects mid-stream the request is aborted in the engine.

The engine is any `EngineClient`; nothing here knows whether it is scripted or real.
"""

import inspect
import json
import logging
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from once.engine_http.metrics import EngineMetrics
from once.protocol.engine import (
    FINISH_ERROR,
    EngineClient,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    is_seconds,
)
from once.protocol.errors import EngineOverloadedError, InvalidRequestError, OnceError

logger = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"

_SAMPLING_TYPES = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "max_tokens": (int,),
    "ignore_eos": (bool,),
    "seed": (int, type(None)),
    "logprobs": (int, type(None)),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int_list(value, param: str, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise InvalidRequestError(f"{param} must be a list of integers", param=param)


def _check_constraint(value, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object or null", param=param)
    unknown = set(value) - {"kind", "text"}
    if unknown:
        raise InvalidRequestError(f"unknown {param} fields: {sorted(unknown)}", param=param)
    for key in ("kind", "text"):
        if not isinstance(value.get(key, ""), str):
            raise InvalidRequestError(f"{param}.{key} must be a string", param=f"{param}.{key}")


def parse_generate_request(body: bytes) -> GenerateRequest:
    """Strictly typed parse of a GenerateRequest body; any problem is InvalidRequestError."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("body must be a JSON object")
    unknown = set(data) - set(GenerateRequest.__dataclass_fields__)
    if unknown:
        raise InvalidRequestError(f"unknown fields: {sorted(unknown)}", param=min(unknown))
    if not isinstance(data.get("request_id"), str):
        raise InvalidRequestError("request_id must be a string", param="request_id")
    _check_int_list(data.get("prompt_token_ids"), "prompt_token_ids")
    _check_int_list(data.get("forced_output_ids"), "forced_output_ids", nullable=True)
    for key in ("session_key", "cache_salt"):
        if not isinstance(data.get(key), str | None):
            raise InvalidRequestError(f"{key} must be a string or null", param=key)

    sampling = data.get("sampling")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        raise InvalidRequestError("sampling must be an object", param="sampling")
    for key, value in sampling.items():
        param = f"sampling.{key}"
        if key not in SamplingParams.__dataclass_fields__:
            raise InvalidRequestError(f"unknown sampling field {key!r}", param=param)
        if key == "stop_token_ids":
            _check_int_list(value, param)
            continue
        if key == "constraint":
            _check_constraint(value, param)
            continue
        allowed = _SAMPLING_TYPES[key]
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            raise InvalidRequestError(f"{param} has the wrong type", param=param)
    return GenerateRequest.from_dict(data)


OVERLOADED_RETRY_AFTER_S = 1  # an overloaded engine's queue moves in about a second


def _error_response(err: OnceError) -> JSONResponse:
    headers = {"retry-after": str(OVERLOADED_RETRY_AFTER_S)}
    if not isinstance(err, EngineOverloadedError):
        headers = {}
    return JSONResponse({"error": err.to_dict()}, status_code=err.status, headers=headers)


class _EngineStream:
    """One generate stream: NDJSON lines out, and an abort if it ends unfinished."""

    def __init__(self, engine: EngineClient, metrics: EngineMetrics, request_id: str):
        self.engine = engine
        self.metrics = metrics
        self.request_id = request_id
        self.deltas: AsyncIterator[TokenDelta] = _no_deltas()
        self.finished = False

    async def first_delta(self, request: GenerateRequest) -> TokenDelta:
        self.deltas = aiter(self.engine.generate(request))
        try:
            return await anext(self.deltas)
        except StopAsyncIteration:
            raise OnceError("engine ended the stream without a delta") from None

    async def lines(self, first: TokenDelta) -> AsyncIterator[bytes]:
        delta = first
        while True:
            if delta.finished:
                self.finished = True
                self.metrics.observe_finished(delta.finish_reason or FINISH_ERROR, delta.metrics)
            yield (json.dumps(delta.to_dict()) + "\n").encode()
            if self.finished:
                return
            try:
                delta = await anext(self.deltas)
            except OnceError as err:
                delta = TokenDelta(self.request_id, [], FINISH_ERROR, error=err.to_dict())
            except StopAsyncIteration:
                ended = OnceError("engine ended the stream without a finish reason")
                delta = TokenDelta(self.request_id, [], FINISH_ERROR, error=ended.to_dict())
            except Exception as exc:
                logger.exception("engine failed request %s", self.request_id)
                failed = OnceError(f"engine error: {type(exc).__name__}: {exc}")
                delta = TokenDelta(self.request_id, [], FINISH_ERROR, error=failed.to_dict())

    async def close(self) -> None:
        # Shielded: on client disconnect we run inside a cancelled scope, and the abort
        # must still reach the engine.
        with anyio.CancelScope(shield=True):
            if not self.finished:
                try:
                    await self.engine.abort(self.request_id)
                except Exception:
                    logger.exception("abort of %s failed", self.request_id)
            aclose = getattr(self.deltas, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    logger.exception("closing the stream of %s failed", self.request_id)


class _ClosingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends: finished, failed or disconnected."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _json_object(http_request: Request) -> dict:
    try:
        data = json.loads(await http_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return data


def build_engine_app(engine: EngineClient, *, model_name: str) -> FastAPI:
    app = FastAPI(title="once engine", docs_url=None, redoc_url=None)
    metrics = EngineMetrics()
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(OnceError)
    async def once_error_handler(_request: Request, err: OnceError) -> JSONResponse:
        return _error_response(err)

    @app.post("/v1/generate")
    async def generate(http_request: Request) -> Response:
        request = parse_generate_request(await http_request.body())
        stream = _EngineStream(engine, metrics, request.request_id)
        try:
            first = await stream.first_delta(request)
        except Exception as exc:
            await stream.close()
            if isinstance(exc, OnceError):
                return _error_response(exc)
            logger.exception("engine failed request %s", request.request_id)
            return _error_response(OnceError(f"engine error: {type(exc).__name__}: {exc}"))
        return _ClosingStreamingResponse(
            stream.lines(first),
            on_close=stream.close,
            media_type=NDJSON,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/abort")
    async def abort(http_request: Request) -> dict:
        data = await _json_object(http_request)
        request_id = data.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        await engine.abort(request_id)
        return {"request_id": request_id, "aborted": True}

    @app.post("/v1/pause")
    async def pause(http_request: Request) -> dict:
        # A session pause hint (engine/kv/session_pauses.py).
        data = await _json_object(http_request)
        session_key, expected_s = data.get("session_key"), data.get("expected_s")
        if not isinstance(session_key, str) or not session_key:
            raise InvalidRequestError("session_key must be a non-empty string", param="session_key")
        if not is_seconds(expected_s):
            raise InvalidRequestError("expected_s must be seconds >= 0", param="expected_s")
        pause_session = getattr(engine, "pause_session", None)
        if pause_session is not None:
            await pause_session(session_key, float(expected_s))
        return {"session_key": session_key, "hinted": pause_session is not None}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return await engine.stats()

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "once"}],
        }

    @app.get("/healthz")
    async def healthz() -> dict:
        check_health = getattr(engine, "check_health", None)
        if check_health is not None:
            result = check_health()  # an OnceError becomes its JSON error (e.g. 503)
            if inspect.isawaitable(result):
                await result
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = metrics.render(await engine.stats())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


async def _no_deltas() -> AsyncIterator[TokenDelta]:
    # The stream before `start`: nothing (start replaces it with the engine's).
    return
    yield
