"""Server-sent events framing for the Responses and Messages streams (the SDKs' SSE
decoders); Chat Completions' `data:`-only frames are apis/chat/http.py's."""

import json


def sse_frame(event: dict) -> bytes:
    # One `event:` line naming the type, one `data:` line of compact JSON, a blank line.
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def sse_chunk(events: list[dict]) -> bytes:
    """One write of a batch of events."""
    return b"".join(sse_frame(event) for event in events)
