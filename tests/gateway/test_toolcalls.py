import json
import random
import re

import pytest

from once.gateway.prompt.toolcalls import (
    TextDelta,
    ToolCallMalformed,
    ToolCallParsed,
    ToolCallStreamParser,
    parse_tool_calls,
    render_tool_call,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def feed_in_chunks(text: str, sizes: list[int] | None = None, parser=None) -> list:
    parser = parser or ToolCallStreamParser()
    events, start = [], 0
    for size in sizes or []:
        events += parser.feed(text[start : start + size])
        start += size
    events += parser.feed(text[start:])
    events += parser.finish()
    return merge_text(events)


def merge_text(events: list) -> list:
    # Chunking may split text differently; what must not change is the text and the calls.
    merged = []
    for event in events:
        assert not (isinstance(event, TextDelta) and event.text == ""), "empty TextDelta"
        if isinstance(event, TextDelta) and merged and isinstance(merged[-1], TextDelta):
            merged[-1] = TextDelta(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


# -- a random document generator and an independent (regex) reference -------------------

TEXT_FRAGMENTS = [
    "Hello", " world", "\n", "  ", "a < b", "<", "<tool", "x <tool_cal", "3 <= 4", "</tool",
    "<b>", "naïve 😀", "tool_call", "{}", "\n\n", "Done.",
]  # fmt: skip


def random_block(rng: random.Random) -> str:
    arguments = rng.choice([{"city": "Paris"}, {"q": "a < b", "n": [1, 2]}, {}, '{"x": 1}'])
    body = json.dumps({"name": rng.choice(["f", "get_weather", "ls"]), "arguments": arguments})
    if rng.random() < 0.2:
        body = body[:-3]  # malformed
    pad = lambda: rng.choice(["", "\n", " ", "\n\n"])  # noqa: E731
    return f"<tool_call>{pad()}{body}{pad()}</tool_call>"


def random_document(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 10)):
        parts.append(random_block(rng) if rng.random() < 0.35 else rng.choice(TEXT_FRAGMENTS))
    if rng.random() < 0.15:
        parts.append("<tool_call>\n" + rng.choice(['{"name": "f", "arguments": {}}', '{"na']))
    return "".join(parts)


def reference_events(text: str) -> list:
    """Regex reference: blocks, with the whitespace around them removed, split the text."""
    events, block_index = [], 0
    pattern = re.compile(r"\s*<tool_call>(.*?)(?:</tool_call>|\Z)\s*", re.S)
    position = 0
    for match in pattern.finditer(text):
        if match.start() > position:
            events.append(TextDelta(text[position : match.start()]))
        body = match.group(1)
        try:
            call = json.loads(body)
            arguments = call["arguments"]
            if isinstance(arguments, dict):
                arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
            events.append(ToolCallParsed(block_index, call["name"], arguments))
        except json.JSONDecodeError:
            events.append(("malformed", block_index))
        block_index += 1
        position = match.end()
    if position < len(text):
        events.append(TextDelta(text[position:]))
    return events


def comparable(events: list) -> list:
    return [("malformed", e.index) if isinstance(e, ToolCallMalformed) else e for e in events]


def test_random_documents_match_reference_for_any_chunking():
    rng = random.Random(0)
    for _ in range(300):
        text = random_document(rng)
        expected = reference_events(text)
        whole = feed_in_chunks(text)
        assert comparable(whole) == expected, text
        char_by_char = feed_in_chunks(text, [1] * len(text))
        assert char_by_char == whole, text
        sizes = [rng.randint(0, 8) for _ in range(len(text) // 3)]
        assert feed_in_chunks(text, sizes) == whole, text


def test_text_streams_at_once_and_call_arrives_whole():
    parser = ToolCallStreamParser()
    assert parser.feed("Let me check") == [TextDelta("Let me check")]
    assert parser.feed(" the weather.\n") == [TextDelta(" the weather.")]  # "\n" held
    assert parser.feed('<tool_call>\n{"name": "get_weather", ') == []
    assert parser.feed('"arguments": {"city": "Paris"}}\n</tool_') == []
    assert parser.feed("call>") == [ToolCallParsed(0, "get_weather", '{"city":"Paris"}')]
    assert parser.finish() == []


def test_partial_open_tag_is_held_until_disambiguated():
    parser = ToolCallStreamParser()
    assert parser.feed("a <tool_") == [TextDelta("a")]
    assert parser.feed("box> b") == [TextDelta(" <tool_box> b")]
    assert parser.feed(" <") == []
    assert parser.finish() == [TextDelta(" <")]  # a literal "<" at the end is kept


def test_literal_angle_brackets_in_text():
    text = "if a < b and c <= d: print('<tool>')\n"
    assert feed_in_chunks(text, [1] * len(text)) == [TextDelta(text)]
    assert parse_tool_calls(text) == (text.strip(), [])


def test_text_without_tool_calls_is_unchanged():
    text = "  Hello,\n\nworld!\n"
    assert feed_in_chunks(text, [2] * 9) == [TextDelta(text)]


def test_multiple_calls_and_whitespace_between_them():
    text = f"I'll call two tools.\n\n{WEATHER}\n{WEATHER.replace('Paris', 'Rome')}\n"
    events = feed_in_chunks(text, [5] * 40)
    assert events == [
        TextDelta("I'll call two tools."),
        ToolCallParsed(0, "get_weather", '{"city":"Paris"}'),
        ToolCallParsed(1, "get_weather", '{"city":"Rome"}'),
    ]


def test_text_between_and_after_calls_is_emitted():
    text = f"{WEATHER}\nThen:\n{WEATHER}\nAll done.\n"
    assert feed_in_chunks(text) == [
        ToolCallParsed(0, "get_weather", '{"city":"Paris"}'),
        TextDelta("Then:"),
        ToolCallParsed(1, "get_weather", '{"city":"Paris"}'),
        TextDelta("All done.\n"),
    ]


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),  # a string, kept as is
        ('{"name": "f"}', "{}"),
        ('{"name": "f", "arguments": null}', "{}"),
        ('{"name": "f", "parameters": {"a": 1}}', '{"a":1}'),
        ('{"arguments": {"s": "é 😀"}, "name": "f"}', '{"s":"é 😀"}'),
        (
            '  \n\t{"name": "f", "arguments": {"a": {"b": [1, 2.5, null]}}}\n\n ',
            '{"a":{"b":[1,2.5,null]}}',
        ),
    ],
)  # fmt: skip
def test_call_bodies(body, arguments):
    assert feed_in_chunks(f"<tool_call>{body}</tool_call>") == [ToolCallParsed(0, "f", arguments)]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "f", "arguments": {"a": 1}', "not valid JSON"),
        ("", "not valid JSON"),
        ('["f", {}]', "expected a JSON object"),
        ('{"arguments": {}}', "no \"name\""),
        ('{"name": "", "arguments": {}}', "no \"name\""),
        ('{"name": 3, "arguments": {}}', "no \"name\""),
        ('{"name": "f", "arguments": [1]}', "must be an object or a string"),
    ],
)  # fmt: skip
def test_malformed_blocks(body, reason):
    block = f"<tool_call>\n{body}\n</tool_call>"
    events = feed_in_chunks(f"Text. {block} {WEATHER}")
    assert events[0] == TextDelta("Text.")
    malformed = events[1]
    assert isinstance(malformed, ToolCallMalformed)
    assert (malformed.index, malformed.raw) == (0, block)
    assert reason in malformed.reason
    assert events[2] == ToolCallParsed(1, "get_weather", '{"city":"Paris"}')  # parsing goes on


def test_unclosed_block_at_end():
    complete = "<tool_call>\n" + '{"name": "f", "arguments": {"a": 1}}\n'
    assert feed_in_chunks(complete, [3] * 20) == [ToolCallParsed(0, "f", '{"a":1}')]
    truncated = '<tool_call>\n{"name": "f", "argu'
    events = feed_in_chunks("Hi " + truncated, [4] * 20)
    assert events[0] == TextDelta("Hi")
    assert isinstance(events[1], ToolCallMalformed)
    assert events[1].raw == truncated
    assert events[1].reason.startswith("unclosed <tool_call> block")


def test_custom_tags():
    parser = ToolCallStreamParser("[TOOL_CALLS]", "[/TOOL_CALLS]")
    text = 'x [TOOL_CALLS]{"name": "f", "arguments": {}}[/TOOL_CALLS] <tool_call>'
    assert feed_in_chunks(text, [1] * len(text), parser=parser) == [
        TextDelta("x"),
        ToolCallParsed(0, "f", "{}"),
        TextDelta("<tool_call>"),
    ]
    with pytest.raises(ValueError):
        ToolCallStreamParser("", "</x>")


def test_long_arguments_fed_token_by_token():
    content = "line of a file with </tool and <tool_call-like text\n" * 400
    block = render_tool_call("write_file", json.dumps({"path": "a.txt", "content": content}))
    parser = ToolCallStreamParser()
    events = []
    for start in range(0, len(block), 3):
        events += parser.feed(block[start : start + 3])
    events += parser.finish()
    assert len(events) == 1
    assert json.loads(events[0].arguments) == {"path": "a.txt", "content": content}


def test_parse_tool_calls_strips_text_and_keeps_malformed_blocks():
    text, calls = parse_tool_calls(f"\nChecking.\n{WEATHER}\n")
    assert text == "Checking."
    assert calls == [ToolCallParsed(0, "get_weather", '{"city":"Paris"}')]
    bad = "<tool_call>{oops}</tool_call>"
    text, calls = parse_tool_calls(f"A {bad} {WEATHER}")
    assert text == f"A{bad}"
    assert [call.index for call in calls] == [1]
    assert parse_tool_calls("") == ("", [])


def test_render_tool_call_canonical_form():
    rendered = render_tool_call("get_weather", '{ "city" : "Paris",\n"unit": "C" }')
    assert rendered == (
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        "</tool_call>"
    )
    assert render_tool_call("f", '{"s": "é"}') == (
        '<tool_call>\n{"name": "f", "arguments": {"s": "é"}}\n</tool_call>'
    )


@pytest.mark.parametrize(
    ("arguments", "parsed_arguments"),
    [
        ('{"city": "Paris"}', '{"city":"Paris"}'),
        ('{"k": [1, "😀", null], "b": true}', '{"k":[1,"😀",null],"b":true}'),
        ("{}", "{}"),
        ("not json at all", "not json at all"),  # odd history still renders and round-trips
        ('"a json string"', '"a json string"'),
        ("[1, 2]", "[1, 2]"),
    ],
)  # fmt: skip
def test_render_round_trips_through_parse(arguments, parsed_arguments):
    text, calls = parse_tool_calls("Sure.\n" + render_tool_call("tool_x", arguments))
    assert text == "Sure."
    assert calls == [ToolCallParsed(0, "tool_x", parsed_arguments)]
    # Rendering the parsed call again gives the same block: the form is canonical.
    assert render_tool_call("tool_x", parsed_arguments) == render_tool_call("tool_x", arguments)


@pytest.mark.parametrize(
    "text_input",
    [
        "*** Begin Patch\n*** Add File: a.txt\n+x\n*** End Patch\n",  # ends in a newline
        'const r = await tools.ls({});\ntext("a \\"quoted\\" word");',
        "{not json} and <b>tags</b>",
    ],
)
def test_a_free_form_input_is_written_raw_and_read_back_unchanged(text_input):
    block = render_tool_call("apply_patch", text_input, key="input")
    assert block.startswith('<tool_call>\n{"name": "apply_patch"}\n' + text_input)
    for sizes in (None, [1] * len(block), [7, 3, 11]):
        events = feed_in_chunks("Patching.\n" + block, sizes)
        assert events == [TextDelta("Patching."), ToolCallParsed(0, "apply_patch", "", text_input)]


def test_a_name_line_with_other_keys_or_nothing_after_it_is_not_a_raw_input():
    assert feed_in_chunks('<tool_call>\n{"name": "f"}\n</tool_call>') == [
        ToolCallParsed(0, "f", "{}")  # a function called without arguments
    ]
    events = feed_in_chunks('<tool_call>\n{"name": "f", "arguments": {}}\ntrailing\n</tool_call>')
    assert isinstance(events[0], ToolCallMalformed)
    json_form = '<tool_call>\n{"name": "f", "input": "a\\nb"}\n</tool_call>'
    assert feed_in_chunks(json_form) == [ToolCallParsed(0, "f", "", "a\nb")]  # still read
