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


MAX_JSON_DEPTH = 100  # arrays and objects inside each other; tool schemas nest ~10 deep


def error_response(error: OnceError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if isinstance(error, RateLimitError):
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    if error.status >= 500:
        headers["connection"] = "close"  # the client's next request opens a fresh one
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
        value = json.loads(body)
    except json.JSONDecodeError as e:
        raise InvalidJSONError(f"the {what} is not valid JSON: {e}") from None
    except RecursionError:
        value = None
    if value is None and body.strip() != "null" or _too_deep(value):
        raise InvalidJSONError(f"the {what} nests deeper than {MAX_JSON_DEPTH} levels")
    if _holds_lone_surrogate(value):
        raise InvalidRequestError(f"the {what} holds a lone UTF-16 surrogate escape")
    return value


def _holds_lone_surrogate(value: object) -> bool:
    """A lone UTF-16 surrogate escape decodes to a string no encoder takes.

    Checked on the decoded value, not the text: the text is strict UTF-8 (HTTP bodies
    decoded above, WebSocket frames by the server), so a surrogate code point in a decoded
    string can only come from an escape, and json decodes a valid escaped pair to one
    astral code point. An ASCII string holds none (`isascii` reads a flag); any other is
    encoded once, which refuses surrogates: a C loop over the string, where a regex over
    the raw text stopped at every backslash and cost more than the rest of refusing a
    20 MB prompt.
    """
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(child for child in node.values() if isinstance(child, str | dict | list))
        elif isinstance(node, list):
            stack.extend(child for child in node if isinstance(child, str | dict | list))
    return False


def _too_deep(value: object) -> bool:
    # Iterative, over containers only: the cost follows the structure, not the text.
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        if isinstance(node, dict):
            stack.extend(
                (child, depth + 1) for child in node.values() if isinstance(child, dict | list)
            )
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node if isinstance(child, dict | list))
    return False
