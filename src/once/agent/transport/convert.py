"""The loop's Responses-shaped requests as Chat Completions and Messages requests, and
their replies back as Responses output items.

The loop keeps its history as Responses items; a transport for another API converts each
request on the way out and each reply on the way in, so the loop, the cache doctor and
the replay stay the same whichever API is on the wire. The mapping is the inverse of the
gateway's adapters (protocol/chat.py, protocol/messages.py): instructions become the
system prompt; an assistant message and the function calls after it become one assistant
turn; each function call output becomes a tool message (Chat) or a `tool_result` block in
a user turn (Messages).
"""

import json

from once.protocol.responses import (
    FUNCTION_CALL,
    FUNCTION_CALL_OUTPUT,
    MESSAGE,
    message_text,
    output_text,
)


def _turns(items: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive items grouped into turns: (role, items), calls joining the assistant."""
    turns: list[tuple[str, list[dict]]] = []
    for item in items:
        kind = item.get("type", MESSAGE)
        if kind == MESSAGE:
            role = item.get("role", "user")
            turns.append((role, [item]))
        elif kind == FUNCTION_CALL:
            if turns and turns[-1][0] == "assistant":
                turns[-1][1].append(item)
            else:
                turns.append(("assistant", [item]))
        elif kind == FUNCTION_CALL_OUTPUT:
            turns.append(("tool", [item]))
        elif kind == "reasoning":
            continue
        else:
            raise ValueError(f"item type {kind!r} has no equivalent in this API")
    return turns


# -- Chat Completions --------------------------------------------------------------------


def chat_request(request: dict) -> dict:
    messages: list[dict] = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": request["instructions"]})
    for role, items in _turns(list(request.get("input") or [])):
        if role == "tool":
            item = items[0]
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": output_text(item)}
            )
        elif role == "assistant":
            text = "".join(message_text(i) for i in items if i.get("type", MESSAGE) == MESSAGE)
            calls = [_chat_call(i) for i in items if i.get("type") == FUNCTION_CALL]
            message: dict = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
        else:
            messages.append({"role": role, "content": message_text(items[0])})
    body: dict = {"model": request["model"], "messages": messages}
    tools = [_chat_tool(t) for t in request.get("tools") or () if t.get("type") == "function"]
    if tools:
        body["tools"] = tools
    if request.get("max_output_tokens") is not None:
        body["max_completion_tokens"] = request["max_output_tokens"]
    for key in ("temperature", "top_p", "prompt_cache_key"):
        if request.get(key) is not None:
            body[key] = request[key]
    return body


def _chat_call(item: dict) -> dict:
    function = {"name": item["name"], "arguments": item.get("arguments", "")}
    return {"id": item["call_id"], "type": "function", "function": function}


def _chat_tool(tool: dict) -> dict:
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


# -- Messages ----------------------------------------------------------------------------


def messages_request(request: dict, max_tokens: int) -> dict:
    messages: list[dict] = []
    for role, items in _turns(list(request.get("input") or [])):
        if role == "tool":
            item = items[0]
            block = {"type": "tool_result", "tool_use_id": item["call_id"]}
            block["content"] = output_text(item)
            _append(messages, "user", [block])
        elif role == "assistant":
            blocks = []
            for item in items:
                if item.get("type", MESSAGE) == MESSAGE:
                    text = message_text(item)
                    if text:
                        blocks.append({"type": "text", "text": text})
                else:
                    arguments = json.loads(item.get("arguments") or "{}")
                    blocks.append(
                        {"type": "tool_use", "id": item["call_id"], "name": item["name"],
                         "input": arguments}
                    )  # fmt: skip
            _append(messages, "assistant", blocks)
        else:
            role = "system" if role == "developer" else role
            _append(messages, role, [{"type": "text", "text": message_text(items[0])}])
    body: dict = {
        "model": request["model"],
        "max_tokens": request.get("max_output_tokens") or max_tokens,
        "messages": messages,
    }
    if request.get("instructions"):
        body["system"] = request["instructions"]
    tools = [_messages_tool(t) for t in request.get("tools") or () if t.get("type") == "function"]
    if tools:
        body["tools"] = tools
    if request.get("temperature") is not None:
        body["temperature"] = min(1.0, request["temperature"])
    if request.get("prompt_cache_key"):
        body["metadata"] = {"user_id": request["prompt_cache_key"]}
    return body


def _append(messages: list[dict], role: str, blocks: list[dict]) -> None:
    # The results of one turn's tool calls go back together, in one user message.
    previous = messages[-1] if messages else None
    if (
        previous is not None
        and previous["role"] == role == "user"
        and _all_results(previous["content"] + blocks)
    ):
        previous["content"].extend(blocks)
    else:
        messages.append({"role": role, "content": blocks})


def _all_results(blocks: list[dict]) -> bool:
    return all(block["type"] == "tool_result" for block in blocks)


def _messages_tool(tool: dict) -> dict:
    converted = {"name": tool["name"], "input_schema": tool.get("parameters") or {}}
    if tool.get("description"):
        converted["description"] = tool["description"]
    if "type" not in converted["input_schema"]:
        converted["input_schema"] = {"type": "object", **converted["input_schema"]}
    return converted


# -- replies -----------------------------------------------------------------------------


def output_items(text: str, calls: list[tuple[str, str, str]]) -> list[dict]:
    """A reply as the Responses output items a loop appends: (call id, name, arguments)."""
    items: list[dict] = []
    if text:
        part = {"type": "output_text", "text": text, "annotations": []}
        items.append({"type": MESSAGE, "role": "assistant", "content": [part]})
    for call_id, name, arguments in calls:
        items.append(
            {"type": FUNCTION_CALL, "call_id": call_id, "name": name, "arguments": arguments}
        )
    return items


def response_dict(output: list[dict], usage: dict, status: str = "completed") -> dict:
    return {"object": "response", "status": status, "output": output, "usage": usage}
