"""Server-sent events framing for the Responses stream (the `openai` SDK's SSE decoder)."""

import json


def sse_frame(event: dict) -> bytes:
    # One `event:` line naming the type, one `data:` line of compact JSON, a blank line.
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
