"""What the HTTP front ends share: body reads, replies, SSE frames, keep-alives, OpenAPI."""
