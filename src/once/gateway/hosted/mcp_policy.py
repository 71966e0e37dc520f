"""Remote MCP servers as a request declares them, without connecting to any (hosted/mcp.py).

A request's `{"type": "mcp", "server_label", "server_url", ...}` tool names one server.
What the model may call of it, and what needs the client's approval first:

- `allowed_tools`: a list of tool names, or a filter `{tool_names, read_only}`; absent,
  every tool the server lists;
- `require_approval`: "always", "never", or `{always: filter, never: filter}`; absent,
  "always" (the API's default: nothing reaches a server without the client's consent).
  With the object form a tool `never` matches runs at once; every other tool asks.

A filter matches a tool named in its `tool_names`, or whose `readOnlyHint` annotation
equals its `read_only`. The server's tools reach the model through the conversation's
`mcp_list_tools` item (render.py shows it as a namespace named by `server_label`), so a
conversation lists each server once, and its prompt never depends on a server answering
again.
"""

from collections.abc import Callable, Iterable, Sequence

MCP_TOOL = "mcp"
MCP_LIST_TOOLS = "mcp_list_tools"
MCP_CALL = "mcp_call"
MCP_APPROVAL_REQUEST = "mcp_approval_request"
MCP_APPROVAL_RESPONSE = "mcp_approval_response"


def mcp_servers(tools: Iterable[dict]) -> dict[str, dict]:
    """The request's MCP tools by `server_label`."""
    return {str(t["server_label"]): t for t in tools if t.get("type") == MCP_TOOL}


def _matches(tool_filter: object, tool: dict) -> bool:
    if not isinstance(tool_filter, dict):
        return False
    if tool["name"] in (tool_filter.get("tool_names") or ()):
        return True
    read_only = tool_filter.get("read_only")
    annotations = tool.get("annotations") or {}
    hint = annotations.get("readOnlyHint") if isinstance(annotations, dict) else None
    return read_only is not None and hint is not None and bool(hint) == bool(read_only)


def is_allowed(config: dict, tool: dict) -> bool:
    allowed = config.get("allowed_tools")
    if allowed is None:
        return True
    if isinstance(allowed, list):
        return tool["name"] in allowed
    return _matches(allowed, tool)


def needs_approval(config: dict, tool: dict) -> bool:
    rule = config.get("require_approval")
    if rule is None or rule == "always":
        return True
    if rule == "never":
        return False
    return not (isinstance(rule, dict) and _matches(rule.get("never"), tool))


def latest_listing(items: Sequence[dict], server_label: str) -> dict | None:
    """The conversation's last successful `mcp_list_tools` of that server."""
    for item in reversed(items):
        if item.get("type") == MCP_LIST_TOOLS and item.get("server_label") == server_label:
            if not item.get("error"):
                return item
    return None


def approval_rule(
    tools: Iterable[dict], items: Sequence[dict], output: Sequence[dict] = ()
) -> Callable[[str, str], bool]:
    """(server_label, tool name) -> whether a call needs approval, by the request's tools
    and the annotations of the listings in the conversation (`items`) or this response."""
    servers = mcp_servers(tools)

    def rule(server_label: str, name: str) -> bool:
        config = servers.get(server_label)
        if config is None:
            return False
        listing = latest_listing(output, server_label) or latest_listing(items, server_label)
        listing = listing or {}
        listed = {t.get("name"): t for t in listing.get("tools") or ()}
        return needs_approval(config, listed.get(name) or {"name": name})

    return rule


def listing_namespace(item: dict) -> dict:
    """An `mcp_list_tools` item as the namespace tool the prompt shows."""
    functions = []
    for tool in item.get("tools") or ():
        function = {"type": "function", "name": tool["name"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {}
        functions.append(function)
    return {"type": "namespace", "name": item["server_label"], "tools": functions}


def call_result_text(item: dict) -> str:
    """What an `mcp_call` gave back, as its `tool` turn shows it: the output, or the error."""
    error = item.get("error")
    if not error:
        return str(item.get("output") or "")
    if isinstance(error, dict):
        message = error.get("message")
        if message is None:
            content = error.get("content")
            content = content if isinstance(content, list) else ()
            parts = [str(c.get("text", "")) for c in content if isinstance(c, dict)]
            message = "\n".join(p for p in parts if p) or error.get("type", "failed")
        return f"error: {message}"
    return f"error: {error}"


def declined_text(item: dict) -> str:
    """An `mcp_approval_response` that refused the call, as the model reads it."""
    reason = item.get("reason")
    return "The call was not approved." + (f" Reason: {reason}" if reason else "")


def listing_error_text(item: dict) -> str:
    return f"The MCP server {item.get('server_label')!r} could not list its tools: {item['error']}"
