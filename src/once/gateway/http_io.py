"""What every HTTP front end shares: a bounded body, JSON decoding, error replies."""

import json

from fastapi import Request
from fastapi.responses import JSONResponse

from once.protocol.errors import (
    InvalidJSONError,
    InvalidRequestError,
    OnceError,
    PayloadTooLargeError,
    RateLimitError,
)

# Names the request's hosted tools this server has no backend for, left out of the prompt.
IGNORED_TOOLS_HEADER = "once-ignored-tools"


def error_response(error: OnceError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if isinstance(error, RateLimitError):
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse({"error": error.to_dict()}, status_code=error.status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed `limit` bytes."""
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


def decode_json(body: bytes | str, what: str = "body") -> object:
    if isinstance(body, bytes):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"the {what} is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise InvalidJSONError(f"the {what} is not valid JSON: {e}") from None
