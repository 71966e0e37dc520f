"""Hosted tools an operator's MCP backend serves (hosted/backends.py), as the model sees
them and as items, without connecting to anything.

A request's `web_search` (and its `web_search_preview` variants), `file_search` or
`code_interpreter` tool with a backend configured reaches the prompt as a function of one
string argument (the gateway adds its declaration at admission: `hosted_functions`):

    tool type                     the model calls          item
    web_search*                   web_search {query}       web_search_call, action search
    file_search                   file_search {query}      file_search_call, queries
    code_interpreter              code_interpreter {code}  code_interpreter_call, code

Every such item carries `once_output`: the text the model read (the backend's result, or
the error), so a full render of the conversation shows the same tool turn. An item that
lacks it (a client dropped the field, or it came from another server) is rendered from the
SDK's own fields (sources, results, outputs).
"""

HOSTED_FUNCTION = "hosted_function"
OUTPUT_FIELD = "once_output"


# backend key -> (the tool types it serves, the item type, the argument, the description)
BACKEND_KINDS = {
    "web_search": (
        ("web_search", "web_search_2025_08_26", "web_search_preview",
         "web_search_preview_2025_03_11"),
        "web_search_call", "query", "Search the web. Returns the results as text.",
    ),
    "file_search": (
        ("file_search",), "file_search_call", "query",
        "Search the files available to this conversation. Returns the passages found.",
    ),
    "code_interpreter": (
        ("code_interpreter",), "code_interpreter_call", "code",
        "Run Python code and return what it printed.",
    ),
}  # fmt: skip
BACKEND_CALLS = {item: key for key, (_, item, _, _) in BACKEND_KINDS.items()}
KIND_OF_TOOL = {t: key for key, (types, _, _, _) in BACKEND_KINDS.items() for t in types}


def declaration(key: str, description: str | None = None) -> dict:
    """The function the prompt shows for a backend's tool."""
    _, _, argument, default = BACKEND_KINDS[key]
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string"}},
        "required": [argument],
    }
    return {"type": HOSTED_FUNCTION, "name": key, "description": description or default,
            "parameters": parameters}  # fmt: skip


def backend_call_item(key: str, arguments: dict, container_id: str = "") -> dict:
    """The item of the model's call of a backend's function (ids and status: the builder's)."""
    _, item_type, argument, _ = BACKEND_KINDS[key]
    value = arguments.get(argument, arguments.get("input", ""))
    value = value if isinstance(value, str) else str(value)
    if item_type == "web_search_call":
        return {"type": item_type, "action": {"type": "search", "query": value}}
    if item_type == "file_search_call":
        return {"type": item_type, "queries": [value]}
    return {"type": item_type, "code": value, "container_id": container_id}


def call_argument(item: dict) -> tuple[str, str]:
    """(argument name, value) of a backend item as the model wrote it."""
    kind = item["type"]
    if kind == "web_search_call":
        action = item.get("action") or {}
        value = action.get("query") or "; ".join(action.get("queries") or ()) or ""
        return "query", str(value or action.get("url") or "")
    if kind == "file_search_call":
        return "query", "; ".join(item.get("queries") or ())
    return "code", str(item.get("code") or "")


def call_parts(item: dict) -> tuple[str, str, object]:
    name, value = call_argument(item)
    return BACKEND_CALLS[item["type"]], "arguments", {name: value}


def result_text(item: dict) -> str:
    """What the model reads after a backend's call."""
    if isinstance(item.get(OUTPUT_FIELD), str):
        return item[OUTPUT_FIELD]
    kind = item["type"]
    if kind == "web_search_call":
        sources = (item.get("action") or {}).get("sources") or ()
        text = "\n".join(str(s.get("url")) for s in sources if isinstance(s, dict))
    elif kind == "file_search_call":
        results = item.get("results") or ()
        text = "\n\n".join(str(r.get("text") or "") for r in results if isinstance(r, dict))
    else:
        outputs = item.get("outputs") or ()
        text = "\n".join(
            str(o.get("logs") if o.get("type") == "logs" else f"[image {o.get('url')}]")
            for o in outputs
            if isinstance(o, dict)
        )
    return text or f"({item.get('status', 'completed')}, no result kept)"
