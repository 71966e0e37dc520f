"""What every HTTP front end shares: a bounded body, JSON decoding, error replies."""

import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse

from once.protocol.errors import (
    EngineOverloadedError,
    InvalidJSONError,
    InvalidRequestError,
    OnceError,
    PayloadTooLargeError,
    RateLimitError,
    RequestTimeoutError,
)

# Names the request's hosted tools this server has no backend for, left out of the prompt.
IGNORED_TOOLS_HEADER = "once-ignored-tools"


MAX_JSON_DEPTH = 100  # arrays and objects inside each other; tool schemas nest ~10 deep
# A candidate `\uD800`-`\uDFFF` escape; whether its backslash is itself escaped is decided
# by counting the backslashes before it, so the scan is one pass of a plain pattern.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD]([89abAB]|[c-fC-F])[0-9a-fA-F]{2}")


def error_response(error: OnceError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if isinstance(error, RateLimitError):
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    elif isinstance(error, EngineOverloadedError):
        headers["retry-after"] = "1"  # the engine refused it before any token: retry soon
    if error.status >= 500 or isinstance(error, RequestTimeoutError):
        # The client's next request opens a fresh one (a slow body is left unread).
        headers["connection"] = "close"
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
    _check_surrogates(body, what)
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        raise InvalidJSONError(f"the {what} is not valid JSON: {e}") from None
    except RecursionError:
        value = None
    if value is None and body.strip() != "null" or _too_deep(value):
        raise InvalidJSONError(f"the {what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _check_surrogates(text: str, what: str) -> None:
    """A lone UTF-16 surrogate escape decodes to a string no encoder takes: refuse it."""
    if "\\ud" not in text and "\\uD" not in text:
        return
    pending_high = -1  # end offset of a high surrogate escape waiting for its low half
    for match in _SURROGATE_ESCAPE.finditer(text):
        escape_start = match.start()
        if _backslashes_before(text, escape_start) % 2:
            continue  # `\\u...`: an escaped backslash, then plain text
        is_high = match.group(1) in "89abAB"
        if not is_high and pending_high == escape_start:
            pending_high = -1
            continue
        if pending_high != -1 or not is_high:
            raise InvalidRequestError(f"the {what} holds a lone UTF-16 surrogate escape")
        pending_high = match.end()
    if pending_high != -1:
        raise InvalidRequestError(f"the {what} holds a lone UTF-16 surrogate escape")


def _backslashes_before(text: str, end: int) -> int:
    start = end
    while start > 0 and text[start - 1] == "\\":
        start -= 1
    return end - start


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
