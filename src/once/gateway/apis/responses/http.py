"""The Responses API over HTTP: `POST /v1/responses` as JSON or SSE, and stored responses.

A thin front end: it reads the bounded body, hands it to the pipeline, and writes what the
pipeline yields, either the final response object (JSON) or the events as SSE frames.
"""

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from once.gateway.apis.responses.events import ResponsesEncoder
from once.gateway.apis.responses.input_items import chain_items, page, parse_query
from once.gateway.front.door import FrontDoor
from once.gateway.front.http_admit import admit_http
from once.gateway.front.http_io import error_response
from once.gateway.front.http_reply import reply
from once.gateway.front.sse import sse_chunk
from once.gateway.prepare import Prepared
from once.protocol.errors import InvalidRequestError, ResponseNotFoundError
from once.protocol.responses import parse_request


def no_frames(events: list[dict]) -> None:
    return None


def responses_encoder(prepared: Prepared) -> ResponsesEncoder:
    return ResponsesEncoder(prepared.request, prepared.response_id, prepared.created_at)


def responses_routes(door: FrontDoor) -> APIRouter:
    pipeline = door.pipeline
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(http: Request):
        admission = await admit_http(door, http, parse_request)
        if not admission.request.generate:
            raise InvalidRequestError("generate=false is a WebSocket-mode field", param="generate")
        prepared = await pipeline.prepare(admission)
        encoder = responses_encoder(prepared)
        return await reply(door, prepared, encoder, sse_chunk, error_response, http)

    @router.post("/v1/responses/input_tokens")
    async def count_input_tokens(http: Request):
        admission = await admit_http(door, http, parse_request, count_bytes=False)
        tokens = await pipeline.count_prompt_tokens(admission)
        return {"object": "response.input_tokens", "input_tokens": tokens}

    @router.api_route(
        "/v1/responses/input_tokens", methods=["GET", "DELETE"], include_in_schema=False
    )
    async def input_tokens_other_methods():
        # The concrete path wins over /v1/responses/{response_id}, as OpenAPI reads paths:
        # a GET here is a 405, not a lookup of a response named "input_tokens".
        raise HTTPException(status_code=405)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, http: Request):
        tenant = door.keyring.authenticate(http.headers.get("authorization"))
        record = await door.store.get(response_id, tenant.name)
        if record is None:
            raise ResponseNotFoundError(f"no response with id {response_id!r}", param="id")
        return JSONResponse(record.response)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, http: Request):
        tenant = door.keyring.authenticate(http.headers.get("authorization"))
        order, limit, after = parse_query(http.query_params)
        record = await door.store.get(response_id, tenant.name)
        if record is None:
            raise ResponseNotFoundError(f"no response with id {response_id!r}", param="id")
        items = await chain_items(door.store, record, tenant.name)
        return JSONResponse(page(items, order, limit, after))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, http: Request):
        tenant = door.keyring.authenticate(http.headers.get("authorization"))
        if not await door.store.delete(response_id, tenant.name):
            raise ResponseNotFoundError(f"no response with id {response_id!r}", param="id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return router
