"""Tool calls written in the chat template's format, parsed as the text streams in.

Qwen-family (Hermes) templates have the model write each call as a tagged JSON object:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The stream parser is a two-state machine over the decoded text:

- outside a block, text streams at once as `TextDelta`, except a tail that could still
  grow into the open tag ("<tool_" at the end of a chunk) and trailing whitespace, both
  held until the next chunk says what they are;
- inside a block, text is buffered until the close tag, then one `ToolCallParsed` (or
  `ToolCallMalformed` when the body is not a call) is emitted.

Whitespace that touches a block (the newline before it, the newlines between two blocks
or after the last one) is dropped; all other text passes through unchanged, so a reply
with no tool call comes out exactly as written. Block indexes count every block, parsed
or malformed, in order of appearance.

A free-form (`custom`) tool's input is written raw, as OpenAI's custom tools take it: the
block holds `{"name": ...}` alone on its first line and the input on the lines after it
(one newline after the name line and one before the close tag are the form's, not the
input's). `{"name", "input"}` with the input as a JSON string is read too.

Leniencies, as in vLLM's Hermes parser: a block still open at the end of the output is
accepted when its body is a complete call (the close tag was cut by a stop sequence);
"parameters" is read when "arguments" is absent (Llama 3 style); a missing "arguments"
means no arguments ("{}"). A close tag inside a JSON string ends the block early (the
body is then malformed), as with every tag-based parser.
"""

import json
from dataclasses import dataclass, field

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class TextDelta:
    text: str


@dataclass
class ToolCallParsed:
    index: int
    name: str
    arguments: str  # compact JSON when the model wrote an object; its string as written
    input: str | None = None  # a free-form tool's text input (`{"name", "input"}`)
    # The whole block, shown as text when the call does not fit its tool (not part of
    # what the call is: two parses of one call are equal however it was spaced).
    raw: str = field(default="", compare=False)


@dataclass
class ToolCallMalformed:
    index: int
    raw: str  # the whole block, tags included, so it can be shown as text instead
    reason: str


ParseEvent = TextDelta | ToolCallParsed | ToolCallMalformed


class ToolCallStreamParser:
    def __init__(self, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG):
        if not open_tag or not close_tag:
            raise ValueError("open_tag and close_tag must be non-empty")
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._inside_block = False
        self._held = ""  # outside: undecided tail; inside: the block's body so far
        self._close_search_start = 0  # inside: the body before this holds no close tag
        self._after_block = False  # outside: no text emitted since the last block closed
        self._num_blocks = 0

    def feed(self, text: str) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        self._held += text
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ParseEvent]:
        """End of output: emit held text, and the open block as a call or as malformed."""
        events: list[ParseEvent] = []
        if self._inside_block:
            body = self._held
            event = self._parse_block(body, raw=self.open_tag + body)
            if isinstance(event, ToolCallMalformed):
                event.reason = f"unclosed {self.open_tag} block ({event.reason})"
            events.append(event)
        else:
            text = self._held.lstrip() if self._after_block else self._held
            if text:
                events.append(TextDelta(text))
        self._inside_block = False
        self._held = ""
        return events

    def _step(self, events: list[ParseEvent]) -> bool:
        """Consume what `_held` allows; True when it changed state and may allow more."""
        if self._inside_block:
            close_at = self._held.find(self.close_tag, self._close_search_start)
            if close_at < 0:
                # A close tag may straddle the next chunk: rescan only that overlap.
                self._close_search_start = max(0, len(self._held) - len(self.close_tag) + 1)
                return False
            body = self._held[:close_at]
            raw = self.open_tag + body + self.close_tag
            events.append(self._parse_block(body, raw=raw))
            self._held = self._held[close_at + len(self.close_tag) :]
            self._inside_block = False
            self._after_block = True
            return True

        open_at = self._held.find(self.open_tag)
        if open_at >= 0:
            text = self._held[:open_at].rstrip()
            self._emit_text(text, events)
            self._held = self._held[open_at + len(self.open_tag) :]
            self._inside_block = True
            self._close_search_start = 0
            return True
        # No open tag yet: hold a tail that may become one, and whitespace before it.
        undecided = len(self._held) - _partial_tag_length(self._held, self.open_tag)
        decided = self._held[:undecided].rstrip()
        self._emit_text(decided, events)
        self._held = self._held[len(decided) :]
        return False

    def _emit_text(self, text: str, events: list[ParseEvent]) -> None:
        if self._after_block:
            text = text.lstrip()
        if text:
            events.append(TextDelta(text))
            self._after_block = False

    def _parse_block(self, body: str, *, raw: str) -> ToolCallParsed | ToolCallMalformed:
        index = self._num_blocks
        self._num_blocks += 1
        try:
            name, arguments, text_input = _parse_call(body)
        except ValueError as error:
            return ToolCallMalformed(index, raw, str(error))
        return ToolCallParsed(index, name, arguments, text_input, raw)


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _parse_call(body: str) -> tuple[str, str, str | None]:
    raw_input = _raw_input_call(body)
    if raw_input is not None:
        return raw_input
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON: {error}") from None
    if not isinstance(call, dict):
        raise ValueError(f"expected a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('no "name" string')
    arguments = call.get("arguments", call.get("parameters"))
    if arguments is None and isinstance(call.get("input"), str):
        return name, "", call["input"]
    if arguments is None:
        return name, "{}", None
    if isinstance(arguments, str):
        return name, arguments, None
    if isinstance(arguments, dict):
        return name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")), None
    raise ValueError(f'"arguments" must be an object or a string, got {type(arguments).__name__}')


def _raw_input_call(body: str) -> tuple[str, str, str] | None:
    """A `{"name": ...}` line followed by raw input; None when the body is not that form."""
    head, newline, rest = body.lstrip("\n").partition("\n")
    if not newline or not rest.strip():
        return None
    try:
        call = json.loads(head)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or set(call) != {"name"} or not isinstance(call["name"], str):
        return None
    if not call["name"]:
        return None
    return call["name"], "", rest[:-1] if rest.endswith("\n") else rest


def parse_tool_calls(
    text: str, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG
) -> tuple[str, list[ToolCallParsed]]:
    """Whole-output parse: the text without parsed blocks (stripped), and the calls.

    Malformed blocks stay in the text, verbatim, so nothing the model wrote is lost.
    """
    parser = ToolCallStreamParser(open_tag, close_tag)
    pieces: list[str] = []
    calls: list[ToolCallParsed] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ToolCallParsed):
            calls.append(event)
        elif isinstance(event, ToolCallMalformed):
            pieces.append(event.raw)
        else:
            pieces.append(event.text)
    return "".join(pieces).strip(), calls


def render_tool_call(name: str, arguments: object, key: str = "arguments") -> str:
    """The canonical block for a call item, as the prompt renderer writes it.

    Arguments that are a JSON object are embedded as that object (so any spacing the
    client used is normalized); anything else is embedded as a JSON string, which
    `parse_tool_calls` gives back unchanged, so rendering never fails on odd history. A
    free-form tool's `input` is written raw after its name line.
    """
    if key == "input":
        head = json.dumps({"name": name}, ensure_ascii=False)
        return f"{OPEN_TAG}\n{head}\n{arguments}\n{CLOSE_TAG}"
    value = arguments
    if key == "arguments" and isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        value = parsed if isinstance(parsed, dict) else arguments
    call = json.dumps({"name": name, key: value}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{call}\n{CLOSE_TAG}"
