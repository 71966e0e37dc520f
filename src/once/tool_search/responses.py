"""Responses API tool definitions as search entries, and search results as loaded tools.

A request's searchable tools are its `function` tools and the functions inside its
`namespace` tools that carry `defer_loading: true` (for a namespace, `defer_loading`
applies to the functions inside it, not to the namespace object). Each becomes a
`(ToolDoc, payload)` entry whose payload is what loading it means:

    {"type": "function", "name": "get_weather", ...}            as declared
    {"type": "namespace", "name": "crm", "description": ...,    the namespace, holding
     "tools": [{"type": "function", "name": "list_orders"}]}    only that function

`merge_namespaces` turns ranked payloads into a `tool_search_output`'s `tools`: the
matches of one namespace in one namespace object, placed where its best match ranked.
"""

from collections.abc import Iterable, Mapping

from once.tool_search.documents import ToolDoc


def _doc(function: Mapping, namespace: str = "") -> ToolDoc:
    parameters = function.get("parameters")
    return ToolDoc(
        str(function["name"]),
        str(function.get("description") or ""),
        parameters if isinstance(parameters, Mapping) else {},
        namespace,
    )


def _searchable(tool: Mapping, deferred_only: bool) -> bool:
    return tool.get("type", "function") == "function" and (
        bool(tool.get("defer_loading")) or not deferred_only
    )


def response_tool_entries(
    tools: Iterable[Mapping], *, deferred_only: bool = True
) -> list[tuple[ToolDoc, dict]]:
    """`deferred_only=False` indexes every function, loaded or not."""
    entries = []
    for tool in tools:
        if tool.get("type") == "namespace":
            namespace = str(tool["name"])
            for function in tool.get("tools") or ():
                if _searchable(function, deferred_only):
                    payload = {
                        "type": "namespace",
                        "name": namespace,
                        "description": tool.get("description") or "",
                        "tools": [dict(function)],
                    }
                    entries.append((_doc(function, namespace), payload))
        elif _searchable(tool, deferred_only):
            entries.append((_doc(tool), dict(tool)))
    return entries


def merge_namespaces(tools: Iterable[dict]) -> list[dict]:
    merged: list[dict] = []
    namespaces: dict[str, dict] = {}
    for tool in tools:
        if tool.get("type") != "namespace":
            merged.append(tool)
        elif tool["name"] in namespaces:
            namespaces[tool["name"]]["tools"].extend(tool["tools"])
        else:
            namespaces[tool["name"]] = {**tool, "tools": list(tool["tools"])}
            merged.append(namespaces[tool["name"]])
    return merged
