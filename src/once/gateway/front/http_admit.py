"""The opening every HTTP front end shares: read the bounded body, count its bytes, admit.

The clock of the time the gateway adds starts once the body is in (a slow upload is the
client's time, bounded by slow_clients.py); the bytes are counted before decoding, so a
refused body counts too.
"""

import time
from collections.abc import Callable

from fastapi import Request

from once.gateway.front.door import FrontDoor
from once.gateway.front.http_io import decode_json, read_body
from once.gateway.pipeline import Admission
from once.protocol.responses import ResponsesRequest

TRANSPORT = "http"


def bearer(http: Request) -> str | None:
    return http.headers.get("authorization")


async def admit_http(
    door: FrontDoor,
    http: Request,
    parse: Callable[[object], ResponsesRequest],
    *,
    api: str = "responses",
    authorization: Callable[[Request], str | None] = bearer,
    count_bytes: bool = True,
) -> Admission:
    body = await read_body(http, door.max_body_bytes)
    received_at = time.perf_counter()
    if count_bytes:
        door.metrics.received_bytes.labels(TRANSPORT).inc(len(body))
    return await door.pipeline.admit(
        decode_json(body),
        authorization(http),
        transport=TRANSPORT,
        received_at=received_at,
        parse=parse,
        api=api,
    )
