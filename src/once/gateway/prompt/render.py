"""Responses items -> chat messages -> prompt text, with the model's own chat template.

Two renderings, chosen by what the template can do:

- **Tool-aware ChatML** (templates that render only role and string content, such as
  SmolLM2's): once writes the tool markup into the message strings itself, then lets the
  model's template render the messages. The format, documented in docs/rendering.md:
  the request's `tools` serialized canonically (sorted by name, keys sorted, fixed
  separators) inside `<tools>...</tools>` at the end of the system block; a `function_call`
  item as a `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block in its assistant
  turn; a `function_call_output` as a `tool` turn holding `<tool_response>...
  </tool_response>`; a `tool_search_output` (tools discovered mid-session) as a `tool`
  turn holding the new definitions in `<tools>...</tools>`, where it occurs, so the head of
  the prompt never changes when tools are discovered. The hosted tools' items (a
  `program` and its `program_output`, an MCP server's `mcp_list_tools`, its `mcp_call`s
  and approvals) are calls, tool turns and system turns the same way; a program's own
  calls and their outputs show nothing (only the program reads them).
- **Native tools** (templates that mention `tools`, such as Qwen's): messages carry
  `tool_calls` and `role: tool`, and the tool list goes to the template.

A continuation renders only its new messages: the template is applied to a fixed anchor
conversation with and without the new messages, and the difference is the new text.
This holds for templates that render each message independently of the others; the
background verification in `tokens.py` catches any template where it does not.
"""

import json
from collections.abc import Sequence

from once.gateway.hosted.backend_tools import BACKEND_CALLS, HOSTED_FUNCTION
from once.gateway.hosted.backend_tools import result_text as backend_result_text
from once.gateway.hosted.mcp_policy import (
    MCP_APPROVAL_RESPONSE,
    MCP_CALL,
    MCP_LIST_TOOLS,
    call_result_text,
    declined_text,
    listing_error_text,
    listing_namespace,
)
from once.gateway.hosted.program_tool import (
    PROGRAM_TOOL_TYPE,
    allows,
    is_program_internal,
    program_tool,
)
from once.gateway.prompt.tool_items import (
    CALL_TYPES,
    HOSTED_CALL_TYPES,
    OUTPUT_TYPES,
    TOOL_SEARCH_PARAMETERS,
    TYPED_CLIENT_TOOLS,
    call_parts,
    is_tool_search,
    output_item_text,
)
from once.gateway.prompt.toolcalls import render_tool_call
from once.protocol.errors import InvalidRequestError
from once.protocol.responses import (
    ADDITIONAL_TOOLS,
    MESSAGE,
    TOOL_SEARCH_OUTPUT,
    canonical_json,
    message_text,
)

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# Only when the tools hold such kinds, so a prompt with plain functions never changes.
NAMESPACE_NOTE = (
    '\n\nA tool listed inside a "namespace" is called by the namespace\'s name, a dot, and '
    "the tool's name: <namespace>.<tool>."
)
CUSTOM_NOTE = (
    '\n\nA tool of type "custom" takes free-form text, not JSON: write its name, then the '
    'text itself on the lines after it (in the tool\'s "format" grammar when it has one):\n'
    '<tool_call>\n{"name": <tool-name>}\n<the text>\n</tool_call>'
)

# The anchor conversation continuations are rendered against. Its contents never reach
# a prompt; they only need to be strings no real message equals.
_ANCHOR_MARK = "\x00once-anchor\x00"
_ANCHOR = (
    {"role": "system", "content": _ANCHOR_MARK + "system"},
    {"role": "user", "content": _ANCHOR_MARK + "user"},
)


class NotIncrementalError(Exception):
    """The template does not render these messages independently of what precedes them."""


def canonical_tool(tool: dict, tools: Sequence[dict] = ()) -> dict | None:
    """The fields of a tool that reach the prompt, in one fixed shape (tool_items.py says
    how each kind is called); None for a hosted tool, which does not reach it. `tools`, the
    whole list, is what the `program` tool's description lists (program_tool.py)."""
    kind = tool.get("type") or ("namespace" if "tools" in tool else "function")
    if kind == PROGRAM_TOOL_TYPE:
        return program_tool(tools)
    if kind == "namespace":
        out: dict = {"type": "namespace", "name": tool.get("name", "")}
        if tool.get("description"):
            out["description"] = tool["description"]
        out["tools"] = sorted_tools(tool.get("tools") or ())
        return out
    if kind == "custom":
        out = {"type": "custom", "name": tool.get("name", "")}
        if tool.get("description"):
            out["description"] = tool["description"]
        if tool.get("format"):
            out["format"] = tool["format"]
        return out
    if is_tool_search(tool):
        out = {"type": "function", "name": "tool_search"}
        if tool.get("description"):
            out["description"] = tool["description"]
        out["parameters"] = tool.get("parameters") or TOOL_SEARCH_PARAMETERS
        return out
    if kind in TYPED_CLIENT_TOOLS:
        return {"type": "function", "name": kind, "parameters": TYPED_CLIENT_TOOLS[kind][2]}
    if kind not in ("function", HOSTED_FUNCTION):
        return None
    out = {"type": "function", "name": tool.get("name", "")}
    if tool.get("description"):
        out["description"] = tool["description"]
    out["parameters"] = tool.get("parameters") or {}
    return out


def sorted_tools(tools: Sequence[dict]) -> list[dict]:
    shown = direct_tools(head_tools(tools))
    canon = [c for c in (canonical_tool(t, tools) for t in shown) if c is not None]
    # The whole serialization breaks ties, so even two tools of one name have one order.
    return sorted(canon, key=lambda t: (t["name"], canonical_json(t)))


def direct_tools(tools: Sequence[dict]) -> Sequence[dict]:
    """Without the tools only a program may call (`allowed_callers` without "direct")."""
    if not any("allowed_callers" in t or t.get("type") == "namespace" for t in tools):
        return tools
    kept = []
    for tool in tools:
        if not allows(tool, "direct"):
            continue
        if tool.get("type") == "namespace":
            nested = [t for t in tool.get("tools") or () if allows(t, "direct", tool)]
            if not nested:
                continue
            tool = {**tool, "tools": nested}
        kept.append(tool)
    return kept


def head_tools(tools: Sequence[dict]) -> Sequence[dict]:
    """With a `tool_search` tool, the tools marked `defer_loading` stay out of the prompt
    until a search finds them (a namespace keeps those it does not defer)."""
    if not any(is_tool_search(t) for t in tools):
        return tools
    kept = []
    for tool in tools:
        if tool.get("defer_loading"):
            continue
        if tool.get("type") == "namespace":
            nested = [t for t in tool.get("tools") or () if not t.get("defer_loading")]
            if not nested:
                continue
            tool = {**tool, "tools": nested}
        kept.append(tool)
    return kept


def tools_block(tools: Sequence[dict]) -> str:
    return "\n".join(canonical_json(tool) for tool in sorted_tools(tools))


def tools_section(tools: Sequence[dict]) -> str:
    """The tools block with its instructions, as the system turn holds it."""
    canon = sorted_tools(tools)
    kinds = {tool["type"] for tool in canon}
    nested = {t["type"] for tool in canon for t in tool.get("tools", ())}
    text = TOOLS_PREAMBLE + "\n".join(canonical_json(t) for t in canon) + TOOLS_POSTAMBLE
    if "namespace" in kinds:
        text += NAMESPACE_NOTE
    if "custom" in kinds | nested:
        text += CUSTOM_NOTE
    return text


class PromptRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("the tokenizer has no chat template")
        self.native_tools = "tools" in template
        self.eos_text = tokenizer.eos_token or ""
        closed = self.render([*_ANCHOR, {"role": "assistant", "content": _ANCHOR_MARK}], False)
        # What the template writes after an assistant message's content ("<|im_end|>\n").
        self.assistant_close_text = closed[closed.rindex(_ANCHOR_MARK) + len(_ANCHOR_MARK) :]
        # The anchor alone renders the same on every continuation unless tools reach the
        # template (native tools): render it once.
        self._anchor_text = self.render(list(_ANCHOR), False)
        self.generation_prompt_text = self.render(list(_ANCHOR), True)[len(self._anchor_text) :]

    # -- items to messages ---------------------------------------------------------------

    def messages(
        self, instructions: str | None, tools: Sequence[dict], items: Sequence[dict]
    ) -> list[dict]:
        system = self.system_message(instructions, tools)
        return ([system] if system else []) + self.item_messages(items)

    def system_message(self, instructions: str | None, tools: Sequence[dict]) -> dict | None:
        if self.native_tools or not sorted_tools(tools):
            return {"role": "system", "content": instructions} if instructions else None
        parts = [instructions] if instructions else []
        parts.append(tools_section(tools))
        return {"role": "system", "content": "\n\n".join(parts)}

    def item_messages(self, items: Sequence[dict]) -> list[dict]:
        """One chat message per turn; an assistant text and its tool calls share a turn."""
        return [message for message, _ in self.message_spans(items)]

    def message_spans(self, items: Sequence[dict]) -> list[tuple[dict, int]]:
        """Each message with the number of items it and those before it were made of: a
        conversation may be cut after any message at that many items."""
        messages: list[dict] = []
        ends: list[int] = []

        def call(parts: tuple) -> bool:
            """The call joins the assistant turn before it, or opens one: True if joined."""
            joined = bool(messages) and messages[-1]["role"] == "assistant"
            if not joined:
                messages.append({"role": "assistant", "content": "", "_calls": []})
            messages[-1]["_calls"].append(parts)
            return joined

        def tool_turn(text: str, response: bool = True) -> None:
            messages.append({"role": "tool", "content": text, "_calls": []})
            messages[-1]["_response"] = response

        for index, item in enumerate(items):
            kind = item["type"]
            before, joined = len(messages), False
            if is_program_internal(item):
                pass  # a program's own calls and their outputs: only the program reads them
            elif kind == MESSAGE:
                role = item.get("role", "user")
                role = "system" if role == "developer" else role
                messages.append({"role": role, "content": message_text(item), "_calls": []})
            elif kind == MCP_CALL and item.get("approval_request_id"):
                tool_turn(call_result_text(item))  # its approval request showed the call
            elif kind in CALL_TYPES or kind in HOSTED_CALL_TYPES:
                joined = call(call_parts(item))
                if kind == MCP_CALL:  # run by the gateway: its result follows at once
                    tool_turn(call_result_text(item))
                elif kind in BACKEND_CALLS:
                    tool_turn(backend_result_text(item))
            elif kind in OUTPUT_TYPES:
                tool_turn(output_item_text(item))
            elif kind == TOOL_SEARCH_OUTPUT:
                block = "<tools>\n" + tools_block(item.get("tools") or ()) + "\n</tools>"
                tool_turn(block, response=False)
            elif kind == ADDITIONAL_TOOLS and sorted_tools(item.get("tools") or ()):
                section = tools_section(item.get("tools") or ())
                messages.append({"role": "system", "content": section, "_calls": []})
            elif kind == MCP_LIST_TOOLS:
                text = listing_error_text(item) if item.get("error") else ""
                text = text or tools_section([listing_namespace(item)])
                messages.append({"role": "system", "content": text, "_calls": []})
            elif kind == MCP_APPROVAL_RESPONSE and not item.get("approve"):
                tool_turn(declined_text(item))
            # reasoning items, and the calls of hosted tools, carry nothing the model reads
            if len(messages) > before:
                ends.extend([index + 1] * (len(messages) - before))
            if ends and (joined or len(messages) == before):
                ends[before - 1 if joined else -1] = index + 1  # joined the turn before
        return [(self._finish(m), end) for m, end in zip(messages, ends, strict=True)]

    def _finish(self, message: dict) -> dict:
        calls = message.pop("_calls")
        wrap_response = message.pop("_response", False)
        if self.native_tools:
            if calls:
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": _arguments(k, v)}}
                    for n, k, v in calls
                ]
            return message
        if wrap_response:
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        if calls:
            text = message["content"]
            blocks = [render_tool_call(name, value, key) for name, key, value in calls]
            message["content"] = "\n".join(([text] if text else []) + blocks)
        return message

    # -- messages to text ----------------------------------------------------------------

    def render(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> str:
        if not messages:  # every item is one the prompt leaves out, and no instructions
            raise InvalidRequestError(
                "the input holds nothing the model can be shown (only items this server "
                "leaves out of the prompt)",
                param="input",
            )
        kwargs = {}
        if self.native_tools and tools:
            # Through canonical JSON and back: nested keys sorted too, since a template's
            # `tojson` keeps the order it is given.
            kwargs["tools"] = [
                {"type": "function", "function": json.loads(canonical_json(function))}
                for function in (
                    {k: v for k, v in t.items() if k != "type"} for t in sorted_tools(tools)
                )
            ]
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def continuation_text(
        self, new_messages: Sequence[dict], tools: Sequence[dict] | None = None
    ) -> str:
        """Text the template writes for `new_messages` (+ generation prompt) after a turn."""
        native = self.native_tools and tools
        base = self.render(list(_ANCHOR), False, tools) if native else self._anchor_text
        extended = self.render([*_ANCHOR, *new_messages], True, tools)
        if not extended.startswith(base):
            raise NotIncrementalError("the template re-renders earlier turns")
        return extended[len(base) :]


def _arguments(key: str, value: object):
    """A call's arguments as a native template takes them: an object where possible."""
    if key == "input":
        return {"input": value}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value
