"""`EngineClient` over HTTP: talks to a `once engine` server (see server.py).

Errors come back as the same OnceError subclasses the engine raised (rebuilt from the
`{"error": ...}` body with `error_from_dict`). A server that cannot be reached, or a stream
cut mid-way, is `EngineDeadError`. Closing the `generate` iterator early closes the HTTP
stream, and the server aborts the request.
"""

import json
from collections.abc import AsyncIterator

import httpx

from once.protocol.engine import GenerateRequest, TokenDelta
from once.protocol.errors import EngineDeadError, OnceError, error_from_dict

# No read timeout by default: a long prefill on CPU can keep the first delta away for
# minutes, and a stream between tokens is idle by design. Connecting must be quick, and a
# wait for a pooled connection is bounded: a drained pool (a replica flooded past the
# pool's 100 connections, or connections leaked) is then `engine_unavailable`, not a hang.
POOL_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT = httpx.Timeout(None, connect=5.0, pool=POOL_TIMEOUT_S)


def _error_from_response(status_code: int, body: bytes) -> OnceError:
    try:
        error = json.loads(body)["error"]
        if isinstance(error, dict):
            return error_from_dict(error)
    except (ValueError, KeyError, TypeError):
        pass
    text = body[:200].decode(errors="replace")
    if status_code in (502, 503, 504):
        return EngineDeadError(f"engine server answered {status_code}: {text}")
    return OnceError(f"engine server answered {status_code}: {text}")


class RemoteEngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        try:
            async with self._http.stream(
                "POST", "/v1/generate", json=request.to_dict()
            ) as response:
                if response.status_code != 200:
                    raise _error_from_response(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    try:
                        delta = TokenDelta.from_dict(json.loads(line))
                    except (ValueError, KeyError, TypeError) as exc:
                        raise OnceError(f"engine sent a malformed delta: {line[:200]!r}") from exc
                    yield delta
                    if delta.finished:
                        return
        except httpx.TransportError as exc:
            raise self._dead(exc) from exc
        raise EngineDeadError(
            f"engine at {self.base_url} closed the stream of {request.request_id} "
            "before it finished"
        )

    async def abort(self, request_id: str) -> None:
        await self._request("POST", "/v1/abort", json={"request_id": request_id})

    async def pause_session(self, session_key: str, expected_s: float) -> None:
        await self._request(
            "POST", "/v1/pause", json={"session_key": session_key, "expected_s": expected_s}
        )

    async def stats(self) -> dict:
        return await self._request("GET", "/v1/stats")

    async def models(self) -> list[str]:
        body = await self._request("GET", "/v1/models")
        return [model["id"] for model in body["data"]]

    async def check_health(self) -> None:
        await self._request("GET", "/healthz")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "RemoteEngineClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._dead(exc) from exc
        if response.status_code != 200:
            raise _error_from_response(response.status_code, response.content)
        return response.json()

    def _dead(self, exc: httpx.TransportError) -> EngineDeadError:
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return EngineDeadError(f"cannot connect to engine at {self.base_url}: {exc}")
        return EngineDeadError(f"lost the engine at {self.base_url}: {type(exc).__name__}: {exc}")
