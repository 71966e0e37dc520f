"""What an MCP `tools/call` gave back, as text: one rendering for every layer that calls MCP.

The harness's MCP tools (agent/tools/mcp_client.py) and the gateway's hosted MCP calls
(gateway/hosted/mcp.py) both hand a model a result as one string: text parts joined by
newlines, other parts named by type (and MIME type), the structured content as JSON when
there is nothing else.
"""

from mcp.types import CallToolResult

from once.protocol.responses import canonical_json


def result_text(result: CallToolResult) -> str:
    """A `CallToolResult` as one string: text parts joined, other parts named."""
    parts = []
    for item in result.content or ():
        text = getattr(item, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:
            mime = getattr(item, "mime_type", None)
            parts.append(f"[{item.type}{': ' + mime if mime else ''}]")
    if not parts and result.structured_content is not None:
        parts.append(canonical_json(result.structured_content))
    return "\n".join(parts)
