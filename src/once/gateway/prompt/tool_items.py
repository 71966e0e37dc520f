"""The Responses API's tool kinds as the model sees them, and its calls as items again.

Every tool the model can call is written in the prompt as one JSON definition
(render.py) and called in one way, a `<tool_call>` block holding `{"name", "arguments"}`,
or `{"name"}` and the raw input for a free-form (`custom`) tool (toolcalls.py). The item
a call becomes depends on the tool kind the request declared:

    declared tool                  the model calls       item (its output: <item>_output)
    function                       its name              function_call (`namespace`: its
                                                         own name when defer_loading)
    a function in a namespace      <namespace>.<name>    function_call with `namespace`
    custom (also in a namespace)   its (dotted) name     custom_tool_call, `input` text
    tool_search, client execution  tool_search           tool_search_call (tool_search_output)
    local_shell / shell            local_shell / shell   local_shell_call / shell_call
    apply_patch                    apply_patch           apply_patch_call
    programmatic_tool_calling      program (`input`)     program (program_output)
    mcp (a listed server tool)     <server_label>.<name> mcp_call, or mcp_approval_request
                                                         when the call needs approval

Function names cannot hold a dot (the API allows `[A-Za-z0-9_-]`), so a dotted name is
always a namespace's (or an MCP server's). Programs and MCP calls are run by the gateway
(hosted/base.py); the other hosted tools (web search, file search, code interpreter, image
generation, computer use) have no backend here: they are left out of the prompt and
reported (`hosted_tool_names`).
"""

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from once.gateway.hosted.backend_tools import BACKEND_CALLS, HOSTED_FUNCTION, backend_call_item
from once.gateway.hosted.backend_tools import call_parts as backend_call_parts
from once.gateway.hosted.mcp_policy import MCP_APPROVAL_REQUEST, MCP_CALL, MCP_TOOL
from once.gateway.hosted.program_tool import (
    PROGRAM,
    PROGRAM_OUTPUT,
    PROGRAM_TOOL_NAME,
    PROGRAM_TOOL_TYPE,
    new_fingerprint,
)
from once.protocol.responses import (
    ADDITIONAL_TOOLS,
    CUSTOM_TOOL_CALL,
    CUSTOM_TOOL_CALL_OUTPUT,
    FUNCTION_CALL,
    FUNCTION_CALL_OUTPUT,
    TOOL_SEARCH_CALL,
    TOOL_SEARCH_OUTPUT,
    output_text,
)

NAMESPACE_SEPARATOR = "."
# The typed client tools: the name the model calls, the call's item type, the field that
# holds what the model wrote, and the parameters shown to it.
TYPED_CLIENT_TOOLS = {
    "local_shell": (
        "local_shell_call",
        "action",
        {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "working_directory": {"type": "string"},
                "timeout_ms": {"type": "integer"},
            },
            "required": ["command"],
        },
    ),
    "shell": (
        "shell_call",
        "action",
        {
            "type": "object",
            "properties": {
                "commands": {"type": "array", "items": {"type": "string"}},
                "timeout_ms": {"type": "integer"},
            },
            "required": ["commands"],
        },
    ),
    "apply_patch": (
        "apply_patch_call",
        "operation",
        {
            "type": "object",
            "properties": {
                "type": {"enum": ["create_file", "update_file", "delete_file"]},
                "path": {"type": "string"},
                "diff": {"type": "string"},
            },
            "required": ["type", "path"],
        },
    ),
}
TYPED_CALL_ITEMS = {item: (name, field) for name, (item, field, _) in TYPED_CLIENT_TOOLS.items()}
TOOL_SEARCH_PARAMETERS = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query"],
}
PROMPT_TOOL_TYPES = (
    "function", "custom", "namespace", PROGRAM_TOOL_TYPE, HOSTED_FUNCTION, *TYPED_CLIENT_TOOLS,
)  # fmt: skip
CALL_TYPES = (FUNCTION_CALL, CUSTOM_TOOL_CALL, TOOL_SEARCH_CALL, *TYPED_CALL_ITEMS)
# The calls of tools the gateway runs: shown in the assistant turn as calls too.
HOSTED_CALL_TYPES = (PROGRAM, MCP_CALL, MCP_APPROVAL_REQUEST, *BACKEND_CALLS)
OUTPUT_TYPES = (
    FUNCTION_CALL_OUTPUT,
    CUSTOM_TOOL_CALL_OUTPUT,
    PROGRAM_OUTPUT,
    *(item + "_output" for item in TYPED_CALL_ITEMS),
)


def is_client_tool_search(tool: dict) -> bool:
    return tool.get("type") == "tool_search" and tool.get("execution", "server") == "client"


def is_tool_search(tool: dict) -> bool:
    """Either execution: the client runs the search, or the gateway (hosted/base.py) does."""
    return tool.get("type") == "tool_search"


def reaches_prompt(tool: dict) -> bool:
    return tool.get("type", "function") in PROMPT_TOOL_TYPES or is_tool_search(tool)


def hosted_tool_names(tools: Iterable[dict], served: Iterable[str] = ()) -> list[str]:
    """The tools that neither reach the prompt nor have a hosted tool to serve them here
    (`served`: the tool types the gateway's hosted tools run)."""
    served = set(served)
    return [
        str(t.get("name") or t.get("server_label") or t["type"])
        for t in tools
        if not reaches_prompt(t) and t.get("type") not in served
    ]


def declared_types(tools: Iterable[dict], items: Sequence[dict] = ()) -> set[str]:
    """The kinds of tool a request declares (its `tools` and `additional_tools` items)."""
    listed = list(tools)
    for item in items:
        if item.get("type") == ADDITIONAL_TOOLS:
            listed.extend(item.get("tools") or ())
    kinds = set()
    for tool in listed:
        kinds.add(_kind(tool))
        kinds.update(_kind(nested) for nested in tool.get("tools") or ())  # a namespace's
        if tool.get("type") == MCP_TOOL:
            kinds.add(f"{MCP_TOOL}:{tool.get('server_label')}")
        if tool.get("type") == HOSTED_FUNCTION:
            kinds.add(f"{HOSTED_FUNCTION}:{tool.get('name')}")
        if tool.get("type", "function") == "function" and tool.get("defer_loading"):
            kinds.add(f"{DEFERRED}:{tool.get('name')}")
    return kinds


# The API's wire shape for a call of a deferred top-level function (one a tool search
# loads): `namespace` is the function's own name, as the openai-agents SDK expects.
DEFERRED = "deferred"


SERVER_TOOL_SEARCH = "tool_search:server"


def _kind(tool: dict) -> str:
    if is_tool_search(tool):
        return "tool_search" if is_client_tool_search(tool) else SERVER_TOOL_SEARCH
    return str(tool.get("type", "function"))


# -- model calls -> items ----------------------------------------------------------------


def call_item(
    name: str,
    arguments: str,
    text_input: str | None,
    declared: set[str],
    needs_approval: Callable[[str, str], bool] = lambda server_label, name: False,
) -> dict | None:
    """The output item of one parsed call (ids and status are the builder's);
    `needs_approval(server_label, tool name)` decides an MCP call's item. None: a typed
    client tool's call whose arguments do not fit the parameters it was shown (its item
    would not be the API's type; the call is shown as the text it was)."""
    namespace, _, short = name.rpartition(NAMESPACE_SEPARATOR)
    if name == PROGRAM_TOOL_NAME and PROGRAM_TOOL_TYPE in declared:
        code = text_input if text_input is not None else str(_object(arguments).get("code", ""))
        return {"type": PROGRAM, "code": code, "fingerprint": new_fingerprint(code)}
    if namespace and f"{MCP_TOOL}:{namespace}" in declared:
        if text_input is not None:
            arguments = json.dumps({"input": text_input}, ensure_ascii=False)
        kind = MCP_APPROVAL_REQUEST if needs_approval(namespace, short) else MCP_CALL
        return {"type": kind, "server_label": namespace, "name": short, "arguments": arguments}
    if text_input is not None and "custom" in declared:
        item = {"type": CUSTOM_TOOL_CALL, "name": short, "input": text_input}
        return {**item, "namespace": namespace} if namespace else item
    if text_input is not None:  # an input where no custom tool was declared: an argument
        arguments = json.dumps({"input": text_input}, ensure_ascii=False)
    if not namespace and f"{HOSTED_FUNCTION}:{name}" in declared:
        return backend_call_item(name, _object(arguments))
    if name == "tool_search" and SERVER_TOOL_SEARCH in declared:
        return {"type": TOOL_SEARCH_CALL, "execution": "server", "arguments": _object(arguments)}
    if not namespace and name in declared:
        if name == "tool_search":
            return {
                "type": TOOL_SEARCH_CALL,
                "execution": "client",
                "arguments": _object(arguments),
            }
        if name in TYPED_CLIENT_TOOLS:
            item_type, field, _ = TYPED_CLIENT_TOOLS[name]
            value = _object(arguments)
            if name == "local_shell":
                value = {"type": "exec", "env": {}, **value}
            if not _fits(name, value):
                return None
            return {"type": item_type, field: value}
    if not namespace and f"{DEFERRED}:{name}" in declared:
        namespace = name
    item = {"type": FUNCTION_CALL, "name": short, "arguments": arguments}
    return {**item, "namespace": namespace} if namespace else item


@functools.cache
def _typed_value(name: str):
    """The SDK's type of what a typed client tool's call item holds (`action`, ...)."""
    from openai.types.responses import (
        response_apply_patch_tool_call,
        response_function_shell_tool_call,
        response_output_item,
    )
    from pydantic import TypeAdapter

    types: dict[str, Any] = {
        "local_shell": response_output_item.LocalShellCallAction,
        "shell": response_function_shell_tool_call.Action,
        "apply_patch": response_apply_patch_tool_call.Operation,
    }
    return TypeAdapter(types[name])


def _fits(name: str, value: dict) -> bool:
    from pydantic import ValidationError

    try:
        _typed_value(name).validate_python(value, strict=True)
    except ValidationError:
        return False
    return True


def _object(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"input": arguments}
    return value if isinstance(value, dict) else {"input": value}


# -- items -> what the prompt shows ------------------------------------------------------


def call_parts(item: dict) -> tuple[str, str, object]:
    """A call item as the model wrote it: (name, "arguments" or "input", the value)."""
    kind = item["type"]
    name = item.get("name", "")
    if item.get("namespace") and item["namespace"] != name:  # equal: a deferred tool's
        name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    if kind == PROGRAM:
        return PROGRAM_TOOL_NAME, "input", item.get("code", "")
    if kind in (MCP_CALL, MCP_APPROVAL_REQUEST):
        return (
            f"{item.get('server_label')}{NAMESPACE_SEPARATOR}{name}",
            "arguments",
            (item.get("arguments") or "{}"),
        )
    if kind in BACKEND_CALLS:
        return backend_call_parts(item)
    if kind == CUSTOM_TOOL_CALL:
        return name, "input", item.get("input", "")
    if kind == TOOL_SEARCH_CALL:
        return "tool_search", "arguments", item.get("arguments") or {}
    if kind in TYPED_CALL_ITEMS:
        tool_name, field = TYPED_CALL_ITEMS[kind]
        value = dict(item.get(field) or {})
        if kind == "local_shell_call":
            value = {k: v for k, v in value.items() if k not in ("type", "env") and v}
        return tool_name, "arguments", value
    return name, "arguments", item.get("arguments", "")


def output_item_text(item: dict) -> str:
    """The text of any tool output item, as its `tool` turn shows it."""
    if item["type"] == "shell_call_output":
        chunks = item.get("output") or ()
        return "\n".join(
            (chunk.get("stdout") or "") + (chunk.get("stderr") or "")
            for chunk in chunks
            if isinstance(chunk, dict)
        )
    if item["type"] == "apply_patch_call_output":
        return item.get("output") or item.get("status", "")
    if item["type"] == PROGRAM_OUTPUT:
        return str(item.get("result") or "")
    return output_text(item)


def is_tool_listing(item: dict) -> bool:
    return item.get("type") in (TOOL_SEARCH_OUTPUT, ADDITIONAL_TOOLS)
