"""Prompt rendering: parity with the model's own template, and the tool-aware ChatML format.

The format under test is the one `render.py`'s docstring specifies and docs/rendering.md
documents; the last test keeps that document's generated example in step with the code.
"""

import copy
import json
import re
from pathlib import Path

import pytest

from once.gateway.prompt.render import PromptRenderer, canonical_tool, sorted_tools, tools_block
from once.gateway.prompt.tokens import ConversationState, PromptBuilder, render_key
from once.protocol.responses import canonical_json, parse_request

KEY = "test"
DOC = Path(__file__).resolve().parents[2] / "docs" / "rendering.md"

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["cmd"],
    },
    "strict": True,
}
APPLY_PATCH = {
    "type": "function",
    "name": "apply_patch",
    "parameters": {"type": "object", "properties": {"patch": {"type": "string"}}},
}
TOOL_SEARCH = {
    "type": "function",
    "name": "tool_search",
    "description": "Find more tools",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
}
GREP = {
    "type": "function",
    "name": "grep",
    "description": "Search files",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
}


def user(text):
    return {"type": "message", "role": "user", "content": text}


def assistant(text):
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call(name, arguments, call_id="call_1"):
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def call_output(output, call_id="call_1"):
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def reordered(tool: dict) -> dict:
    """The same tool with every dict's keys in reverse order."""

    def reverse(value):
        if isinstance(value, dict):
            return {k: reverse(value[k]) for k in reversed(list(value))}
        if isinstance(value, list):
            return [reverse(v) for v in value]
        return value

    return reverse(tool)


def reference_ids(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    # transformers 5 returns a BatchEncoding; 4.x a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_text(runtime, instructions, tools, items) -> str:
    renderer = runtime.renderer
    return renderer.render(renderer.messages(instructions, tools, items), True, tools)


# -- 1. parity with the reference template ---------------------------------------------------

PARITY_CASES = [
    pytest.param(
        "You are terse.",
        [user("Hello"), assistant("Hi!"), user("How are you?")],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "How are you?"},
        ],
        id="multi-turn",
    ),
    # No system message: the template inserts its default one; once must not add another.
    pytest.param(None, [user("hi")], [{"role": "user", "content": "hi"}], id="default-system"),
    pytest.param(
        None,
        [{"type": "message", "role": "developer", "content": "Answer in French."}, user("hi")],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}],
        id="developer-first",
    ),
    pytest.param(
        "  leading and trailing spaces \n",
        [
            user("def f(x):\n    return x ** 2\n\n"),
            assistant("naïve café 世界 😀👍🏽 🇫🇷\t"),
            user(" \n"),
        ],
        [
            {"role": "system", "content": "  leading and trailing spaces \n"},
            {"role": "user", "content": "def f(x):\n    return x ** 2\n\n"},
            {"role": "assistant", "content": "naïve café 世界 😀👍🏽 🇫🇷\t"},
            {"role": "user", "content": " \n"},
        ],
        id="whitespace-unicode",
    ),
    pytest.param(
        "sys",
        [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "part one, "},
                    {"type": "input_text", "text": "part two"},
                ],
            },
            {"type": "reasoning", "summary": []},
        ],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "part one, part two"}],
        id="content-parts-and-reasoning",
    ),
]


@pytest.mark.parametrize(("instructions", "items", "messages"), PARITY_CASES)
def test_full_render_equals_the_reference_chat_template(runtime, instructions, items, messages):
    built = runtime.builder.full(KEY, instructions, [], items)
    assert built.prompt_ids == reference_ids(runtime.tokenizer, messages)
    assert built.context_ids == reference_ids(runtime.tokenizer, messages, False)
    assert built.mode == "full"
    assert built.num_tokenized == len(built.prompt_ids)


def test_full_render_ends_with_the_generation_prompt(runtime):
    built = runtime.builder.full(KEY, None, [], [user("hi")])
    assert runtime.tokenizer.decode(built.prompt_ids[len(built.context_ids) :]) == (
        "<|im_start|>assistant\n"
    )


def test_a_tokenizer_without_chat_template_is_refused(runtime):
    bare = copy.deepcopy(runtime.tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        PromptRenderer(bare)


# -- 2. tools are canonical; discovery appends, never edits the head -------------------------


def test_tool_order_and_key_order_do_not_change_the_prompt(runtime):
    items = [user("list the files")]
    text = prompt_text(runtime, "sys", [SHELL, APPLY_PATCH, TOOL_SEARCH], items)
    shuffled = [reordered(TOOL_SEARCH), reordered(SHELL), reordered(APPLY_PATCH)]
    assert prompt_text(runtime, "sys", shuffled, items) == text
    assert render_key("m", "sys", shuffled) == render_key(
        "m", "sys", [SHELL, APPLY_PATCH, TOOL_SEARCH]
    )
    # The block: sorted by name, keys sorted, no spaces; `strict` does not reach the prompt.
    block = text[text.index("<tools>\n") + len("<tools>\n") : text.index("\n</tools>")]
    lines = block.split("\n")
    assert [json.loads(line)["name"] for line in lines] == ["apply_patch", "shell", "tool_search"]
    assert lines[1] == (
        '{"description":"Run a shell command","name":"shell","parameters":{"properties":'
        '{"cmd":{"type":"string"},"timeout":{"type":"integer"}},"required":["cmd"],'
        '"type":"object"},"type":"function"}'
    )
    # And a real change is a different prompt and a different render key.
    edited = {**SHELL, "description": "Run a command"}
    assert prompt_text(runtime, "sys", [edited, APPLY_PATCH, TOOL_SEARCH], items) != text
    assert render_key("m", "sys", [edited]) != render_key("m", "sys", [SHELL])


def test_tools_of_one_name_still_have_one_order(runtime):
    other = {**SHELL, "description": "Another shell"}
    assert tools_block([SHELL, other]) == tools_block([other, SHELL])
    first, second = tools_block([SHELL, other]).split("\n")
    assert (first, second) == tuple(canonical_json(canonical_tool(t)) for t in (other, SHELL))


def test_render_key_ignores_tool_order(runtime):
    assert render_key("m", "sys", [SHELL, GREP]) == render_key("m", "sys", [reordered(GREP), SHELL])
    assert render_key("m", "sys", [SHELL]) != render_key("m", "other", [SHELL])
    assert render_key("m", None, []) == render_key("m", "", [])


def test_the_system_block_holds_instructions_then_tools(runtime):
    text = prompt_text(runtime, "Be careful.", [SHELL], [user("go")])
    assert text.startswith("<|im_start|>system\nBe careful.\n\n# Tools\n")
    assert text.index("</tool_call><|im_end|>\n<|im_start|>user\ngo<|im_end|>") > 0
    # Tools without instructions: the block is the whole system message (no default system).
    text = prompt_text(runtime, None, [SHELL], [user("go")])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "SmolLM" not in text


def test_non_function_tools_do_not_reach_the_prompt(runtime):
    hosted = {"type": "web_search"}
    assert sorted_tools([hosted, SHELL]) == [canonical_tool(SHELL)]
    assert tools_block([hosted]) == ""
    assert canonical_tool({"type": "function", "name": "bare"}) == {
        "type": "function",
        "name": "bare",
        "parameters": {},
    }


def test_tool_search_output_renders_where_it_occurs_and_keeps_the_head(runtime):
    builder = runtime.builder
    core = [SHELL, TOOL_SEARCH]
    before = [user("find usages of foo"), call("tool_search", '{"query": "grep"}')]
    discovered = {
        "type": "tool_search_output",
        "call_id": "call_1",
        "execution": "client",
        "status": "completed",
        "tools": [reordered(GREP), APPLY_PATCH, {"type": "web_search"}],
    }
    after = [*before, discovered]
    built_before = builder.full(KEY, "sys", core, before)
    built_after = builder.full(KEY, "sys", core, after)
    assert built_after.prompt_ids[: len(built_before.context_ids)] == built_before.context_ids
    text = prompt_text(runtime, "sys", core, after)
    tail = text[len(prompt_text(runtime, "sys", core, before)) - len("<|im_start|>assistant\n") :]
    assert tail == (
        "<|im_start|>tool\n<tools>\n"
        '{"name":"apply_patch","parameters":{"properties":{"patch":{"type":"string"}},'
        '"type":"object"},"type":"function"}\n'
        '{"description":"Search files","name":"grep","parameters":{"properties":{"pattern":'
        '{"type":"string"}},"type":"object"},"type":"function"}\n'
        "</tools><|im_end|>\n<|im_start|>assistant\n"
    )
    # The head's tool list is the request's, untouched by what was discovered.
    head = text[: text.index("<|im_start|>user")]
    assert '"grep"' not in head and '"apply_patch"' not in head


def test_tool_search_output_with_no_function_tools_renders_an_empty_block(runtime):
    items = [user("x"), {"type": "tool_search_output", "tools": [{"type": "web_search"}]}]
    text = prompt_text(runtime, None, [], items)
    assert "<|im_start|>tool\n<tools>\n\n</tools><|im_end|>\n" in text


# -- 3. calls, outputs, roles ----------------------------------------------------------------


def test_calls_and_outputs_render_as_specified(runtime):
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        user("List files"),
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "secret plan"}]},
        assistant("Let me look."),
        call("shell", '{"cmd":  "ls",\n "timeout": 5}', "c1"),
        call("shell", "not json", "c2"),
        call_output("a.py\nb.py", "c1"),
        call_output(
            [{"type": "input_text", "text": "error: "}, {"type": "input_text", "text": "x"}], "c2"
        ),
        call("shell", '{"cmd": "pwd"}', "c3"),
        call_output("/w", "c3"),
        assistant("Done."),
    ]
    text = prompt_text(runtime, "sys", [], items)
    assert text == (
        "<|im_start|>system\nsys<|im_end|>\n"
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nList files<|im_end|>\n"
        # Text and every call of one turn share one assistant message; arguments that are a
        # JSON object are re-serialized, anything else is embedded as a JSON string.
        "<|im_start|>assistant\nLet me look.\n"
        '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls", "timeout": 5}}\n</tool_call>\n'
        '<tool_call>\n{"name": "shell", "arguments": "not json"}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\na.py\nb.py\n</tool_response><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nerror: x\n</tool_response><|im_end|>\n"
        # A call after a tool turn opens a new assistant turn with no text.
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "shell", "arguments": {"cmd": "pwd"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n/w\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "secret plan" not in text


def test_a_call_without_text_opens_its_own_turn(runtime):
    messages = runtime.renderer.item_messages([user("hi"), call("shell", "{}")])
    assert messages == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "shell", "arguments": {}}\n</tool_call>',
        },
    ]


def test_items_with_odd_fields_still_render(runtime):
    # Validation rejects most of these earlier; the renderer must still not crash on them.
    messages = runtime.renderer.item_messages(
        [
            {"type": "message", "content": "no role"},
            {"type": "message", "role": "user", "content": None},
            {"type": "function_call"},
            {"type": "function_call_output", "output": None},
            {"type": "item_reference", "id": "x"},
        ]
    )
    assert messages == [
        {"role": "user", "content": "no role"},
        {"role": "user", "content": ""},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "", "arguments": ""}\n</tool_call>',
        },
        {"role": "tool", "content": "<tool_response>\n\n</tool_response>"},
    ]


# -- 4. templates with native tool support ---------------------------------------------------

# A small Qwen-style template: tools in the system turn, calls from `message.tool_calls`.
NATIVE_TEMPLATE = (  # newlines as expressions: HF renders with trim_blocks and lstrip_blocks
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}"
    "{% endif %}"
    "{% if tools or system %}{{ '<|im_start|>system\\n' + system }}"
    "{% if tools %}{{ '\\n# Tools\\n<tools>' }}{% for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools>' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in rest %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.role == 'tool' %}"
    "{{ '<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% else %}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls or [] %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{ (tc.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def native_tokenizer(runtime):
    tokenizer = copy.deepcopy(runtime.tokenizer)
    tokenizer.chat_template = NATIVE_TEMPLATE
    return tokenizer


def test_native_template_gets_tools_and_tool_calls(runtime, native_tokenizer):
    renderer = PromptRenderer(native_tokenizer)
    assert renderer.native_tools
    assert not runtime.renderer.native_tools  # the original tokenizer was not touched
    items = [
        user("list"),
        assistant("Looking."),
        call("shell", '{"cmd": "ls"}'),
        call_output("a.py"),
    ]
    messages = renderer.messages("sys", [SHELL, APPLY_PATCH], items)
    assert messages[0] == {"role": "system", "content": "sys"}  # no tools text of once's own
    assert messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "shell", "arguments": {"cmd": "ls"}}}
    ]
    assert messages[3] == {"role": "tool", "content": "a.py"}  # the template wraps it
    text = renderer.render(messages, True, [SHELL, APPLY_PATCH])
    head = text[: text.index("</tools>")]
    # Sorted, canonical tools (keys sorted at every depth) in the template's own shape.
    assert head.index('"name": "apply_patch"') < head.index('"name": "shell"')
    assert '"function": {"description": "Run a shell command", "name": "shell"' in head
    assert '{"properties": {"cmd": {"type": "string"}' in head  # nested keys sorted too
    assert '"strict"' not in head
    assert text.endswith(
        '<|im_start|>assistant\nLooking.\n<tool_call>\n{"name": "shell", "arguments": '
        '{"cmd": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The same tools in another order: the same prompt.
    shuffled = [reordered(APPLY_PATCH), reordered(SHELL)]
    assert renderer.render(renderer.messages("sys", shuffled, items), True, shuffled) == text


def test_native_template_continuation_equals_full_render(native_tokenizer):
    renderer = PromptRenderer(native_tokenizer)
    builder = PromptBuilder(renderer, native_tokenizer)
    first = [user("list")]
    output_items = [call("shell", '{"cmd": "ls"}')]
    output_text = renderer.item_messages(output_items)[0]
    assert "tool_calls" in output_text  # native: the builder must go through the template
    built = builder.full(KEY, "sys", [SHELL], first)
    # Canonical output ids: the assistant turn as the template writes it, up to the eos.
    full_after = renderer.render(
        renderer.messages("sys", [SHELL], [*first, *output_items]), False, [SHELL]
    )
    sampled_text = full_after[
        len(renderer.render(renderer.messages("sys", [SHELL], first), True, [SHELL])) :
    ]
    sampled_text = sampled_text[: sampled_text.rindex("<|im_end|>")]
    output_ids = builder.encode(sampled_text) + [native_tokenizer.eos_token_id]
    state = ConversationState(KEY, built.prompt_ids + output_ids, after_output=True)
    new_items = [call_output("a.py"), user("thanks")]
    continued = builder.continuation(state, [SHELL], new_items)
    expected = builder.full(KEY, "sys", [SHELL], [*first, *output_items, *new_items])
    assert continued.prompt_ids == expected.prompt_ids


# -- the documented example ------------------------------------------------------------------


def doc_block(doc: str, marker: str, lang: str) -> str:
    found = re.search(rf"<!-- {marker} -->\n```{lang}\n(.*?)\n```", doc, re.S)
    assert found, f"docs/rendering.md lost its {marker} block"
    return found.group(1)


def test_docs_example_is_what_the_code_renders(runtime):
    """docs/rendering.md carries generated examples: their inputs still give their outputs."""
    doc = DOC.read_text()
    body = json.loads(doc_block(doc, "example-request", "json"))
    parse_request(body)  # a request the gateway accepts
    instructions, tools, items = body["instructions"], body["tools"], body["input"]
    assert prompt_text(runtime, instructions, tools, items) == doc_block(
        doc, "example-prompt", "text"
    )
    # The continuation: canonical sampled ids + eos, then only the new items' text.
    output = json.loads(doc_block(doc, "example-output", "json"))
    new_items = json.loads(doc_block(doc, "example-new-items", "json"))
    builder, tokenizer = runtime.builder, runtime.tokenizer
    sampled = runtime.renderer.item_messages(output)[0]["content"]
    output_ids = builder.encode(sampled) + [tokenizer.eos_token_id]
    assert tokenizer.decode(output_ids) == doc_block(doc, "example-sampled", "text")
    built = builder.full(KEY, instructions, tools, items)
    state = ConversationState(KEY, built.prompt_ids + output_ids, after_output=True)
    continued = builder.continuation(state, tools, new_items)
    new_ids = continued.prompt_ids[len(state.token_ids) :]
    assert tokenizer.decode(new_ids) == doc_block(doc, "example-continuation", "text")
    full = builder.full(KEY, instructions, tools, [*items, *output, *new_items])
    assert continued.prompt_ids == full.prompt_ids


def test_docs_hosted_example_is_what_the_code_renders(runtime):
    """The hosted tools' example: a program (its own calls not shown), an MCP listing and
    call, as docs/rendering.md says."""
    doc = DOC.read_text()
    body = json.loads(doc_block(doc, "hosted-request", "json"))
    parse_request(body)
    prompt = prompt_text(runtime, None, body["tools"], body["input"])
    assert prompt == doc_block(doc, "hosted-prompt", "text")
