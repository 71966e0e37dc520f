import copy
import json
from pathlib import Path

import pytest

from once.agent.transport.rule import (
    FIELDS_CHANGED,
    FIRST_CALL,
    HISTORY_EDITED,
    INPUT_NOT_A_LIST,
    OUTPUT_NOT_KEPT,
    full_request_reason,
    incremental_request,
)
from once.bench.payloads import (
    MAIN_CHAIN,
    chains,
    median_ratio_by_source,
    messages_to_request,
    output_to_items,
    session_payload_bytes,
    session_requests,
    session_tools,
)
from once.bench.traces import (
    CODER,
    MINI_SWE_AGENT,
    SOURCES,
    SWEAGENT_1_0,
    SWEAGENT_1_1,
    Call,
    Session,
    default_traces_dir,
    load_sessions,
)
from once.protocol.errors import InvalidRequestError

MODEL = "test-model"
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
}


def user(text):
    return {"type": "message", "role": "user", "content": text}


def assistant(text):
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "role": "assistant", "content": content}


def num_bytes(body):
    return len(json.dumps(body, ensure_ascii=False).encode())


def make_session(outputs, source=MINI_SWE_AGENT, agents=None, system="sys"):
    # An append-only mini-swe-agent-like session: call k answers "obs k-1" with outputs[k].
    agents = agents or [None] * len(outputs)
    calls, history = [], [{"role": "system", "content": system}]
    for index, (text, agent) in enumerate(zip(outputs, agents, strict=True)):
        history.append({"role": "user", "content": f"obs {index}"})
        output = {"role": "assistant", "content": text}
        calls.append(Call(index=index, messages=tuple(history), output=output, agent=agent))
        history.append(output)
    return Session(session_id="synthetic/s", source=source, path=Path("s"), calls=tuple(calls))


# --- messages -> Responses items ---


def test_leading_system_becomes_instructions_and_later_system_an_input_message():
    request = messages_to_request(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "note"},
        ],
        model=MODEL,
    )
    assert request == {
        "model": MODEL,
        "instructions": "be brief",
        "input": [user("hi"), {"type": "message", "role": "system", "content": "note"}],
    }


def test_no_system_message_means_no_instructions_and_tools_only_when_given():
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    plain = messages_to_request([{"role": "user", "content": "hi"}], model=MODEL)
    with_tools = messages_to_request([{"role": "user", "content": "hi"}], model=MODEL, tools=tools)
    assert plain == {"model": MODEL, "input": [user("hi")]}
    assert with_tools["tools"] == tools


def test_assistant_text_and_tool_calls_become_a_message_then_function_calls():
    second = {"id": "call_2", "function": {"name": "submit", "arguments": {"a": "é"}}}
    items = output_to_items(
        {"role": "assistant", "content": "let me look", "tool_calls": [TOOL_CALL, second]}
    )
    assert items == [
        assistant("let me look"),
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "bash",
            "arguments": '{"command": "ls"}',
        },
        {"type": "function_call", "call_id": "call_2", "name": "submit", "arguments": '{"a": "é"}'},
    ]


def test_empty_text_with_tool_calls_gives_no_message_item_but_empty_text_alone_does():
    with_call = output_to_items({"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]})
    assert [item["type"] for item in with_call] == ["function_call"]
    assert output_to_items({"role": "assistant", "content": None}) == [assistant("")]


def test_tool_message_becomes_function_call_output():
    request = messages_to_request(
        [{"role": "tool", "content": "a.py", "tool_call_id": "call_1"}], model=MODEL
    )
    assert request["input"] == [
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"}
    ]


def test_appending_output_items_verbatim_gives_the_next_requests_input():
    history = [{"role": "user", "content": "task"}]
    reply = {"role": "assistant", "content": "ok", "tool_calls": [TOOL_CALL]}
    observation = {"role": "tool", "content": "a.py", "tool_call_id": "call_1"}
    first = messages_to_request(history, model=MODEL)
    second = messages_to_request([*history, reply, observation], model=MODEL)
    assert second["input"] == first["input"] + output_to_items(reply) + second["input"][-1:]


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "robot", "content": "x"}, "role"),
        ({"content": "x"}, "role"),
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"role": "user", "content": [{"type": "text", "text": "x"}]}, "content"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
            "tool_calls",
        ),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}, "tool_calls"),
    ],
)
def test_malformed_messages_raise_invalid_request(message, param):
    with pytest.raises(InvalidRequestError) as raised:
        messages_to_request([message], model=MODEL)
    assert raised.value.param == param


def test_output_must_be_an_assistant_message():
    with pytest.raises(InvalidRequestError):
        output_to_items({"role": "user", "content": "x"})


# --- the WebSocket incremental rule ---

PREVIOUS = {"model": MODEL, "instructions": "sys", "input": [user("task")]}
PREVIOUS_OUTPUT = [assistant("ls")]
NEXT = {
    "model": MODEL,
    "instructions": "sys",
    "input": [user("task"), assistant("ls"), user("a.py")],
}


def test_append_only_extension_sends_only_the_new_items():
    sent = incremental_request(PREVIOUS, PREVIOUS_OUTPUT, NEXT, "resp_1")
    # Unchanged fields are inherited on the connection: only the link and new items go.
    assert sent == {
        "previous_response_id": "resp_1",
        "input": [user("a.py")],
    }
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, NEXT) is None


def test_items_are_compared_by_value_not_identity():
    # Equal items built separately (and with keys in another order) still qualify.
    rebuilt = copy.deepcopy(NEXT)
    rebuilt["input"][1] = dict(reversed(list(rebuilt["input"][1].items())))
    sent = incremental_request(PREVIOUS, copy.deepcopy(PREVIOUS_OUTPUT), rebuilt, "resp_1")
    assert sent["input"] == [user("a.py")]


def test_first_call_is_sent_in_full():
    assert incremental_request(None, None, NEXT, "resp_1") is NEXT
    assert full_request_reason(None, None, NEXT) == FIRST_CALL


@pytest.mark.parametrize(
    "change",
    [
        {"instructions": "other"},
        {"model": "other-model"},
        {"tools": [{"type": "function", "name": "bash"}]},
        {"temperature": 0.5},
    ],
)
def test_a_changed_non_input_field_gives_a_full_request(change):
    request = {**NEXT, **change}
    assert incremental_request(PREVIOUS, PREVIOUS_OUTPUT, request, "resp_1") is request
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, request) == FIELDS_CHANGED


def test_a_dropped_instruction_gives_a_full_request():
    request = {key: value for key, value in NEXT.items() if key != "instructions"}
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, request) == FIELDS_CHANGED


def test_an_edited_earlier_item_gives_a_full_request():
    request = {**NEXT, "input": [user("task (edited)"), *NEXT["input"][1:]]}
    assert incremental_request(PREVIOUS, PREVIOUS_OUTPUT, request, "resp_1") is request
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, request) == HISTORY_EDITED


def test_a_previous_output_changed_by_whitespace_gives_a_full_request():
    request = {**NEXT, "input": [user("task"), assistant("ls\n"), user("a.py")]}
    assert incremental_request(PREVIOUS, PREVIOUS_OUTPUT, request, "resp_1") is request
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, request) == OUTPUT_NOT_KEPT


def test_a_request_shorter_than_the_previous_chain_gives_a_full_request():
    request = {**NEXT, "input": [user("task")]}
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, request) == OUTPUT_NOT_KEPT
    truncated = {**NEXT, "input": []}
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, truncated) == HISTORY_EDITED


def test_a_string_input_gives_a_full_request():
    request = {**NEXT, "input": "a.py"}
    assert full_request_reason(PREVIOUS, PREVIOUS_OUTPUT, request) == INPUT_NOT_A_LIST


def test_an_already_incremental_request_is_rejected():
    with pytest.raises(ValueError):
        incremental_request(PREVIOUS, PREVIOUS_OUTPUT, {**NEXT, "previous_response_id": "r"}, "r")


# --- sessions ---


def test_chains_split_coder_by_role_and_keep_other_sources_whole():
    agents = ["Manager", "Reproducer", "Manager", "Programmer"]
    coder = make_session(["a", "b", "c", "d"], source=CODER, agents=agents)
    assert chains(coder) == {"Manager": [0, 2], "Reproducer": [1], "Programmer": [3]}
    assert chains(make_session(["a", "b"])) == {MAIN_CHAIN: [0, 1]}


def test_session_tools_only_for_native_tool_call_sessions():
    assert session_tools(make_session(["a"])) is None
    tools = session_tools(make_session(["a"], source=SWEAGENT_1_1))
    assert [tool["name"] for tool in tools] == ["bash", "str_replace_editor", "submit"]
    assert all(tool["type"] == "function" and "parameters" in tool for tool in tools)


def test_session_payload_bytes_counts_both_ways_exactly():
    session = make_session(["ls", "cat a.py", "done"])
    requests = session_requests(session, model=MODEL)
    result = session_payload_bytes(session, model=MODEL)

    http_bytes = sum(num_bytes(request) for request, _ in requests)
    ws_bytes = num_bytes({"type": "response.create", **requests[0][0]})
    for (previous, output), (request, _) in zip(requests, requests[1:], strict=False):
        incremental = incremental_request(previous, output, request, "resp_" + "0" * 50)
        assert incremental["input"] == [request["input"][-1]]  # just the new observation
        ws_bytes += num_bytes({"type": "response.create", **incremental})
    assert result["http_bytes"] == http_bytes
    assert result["ws_bytes"] == ws_bytes
    assert result["ratio"] == http_bytes / ws_bytes
    assert (result["calls"], result["incremental_calls"], result["full_calls"]) == (3, 2, 1)
    assert result["full_call_reasons"] == {FIRST_CALL: 1}


def test_coder_role_switches_do_not_break_each_roles_chain():
    agents = ["Manager", "Reproducer", "Manager", "Reproducer"]
    coder = make_session(["a", "b", "c", "d"], source=CODER, agents=agents)
    # make_session shares one history; give each role its own chat as traces.py does.
    calls, chats = [], {}
    for call in coder.calls:
        chat = chats.setdefault(call.agent, [{"role": "system", "content": call.agent}])
        chat.append({"role": "user", "content": f"obs {call.index}"})
        calls.append(Call(call.index, tuple(chat), call.output, agent=call.agent))
        chat.append(call.output)
    coder = Session(coder.session_id, CODER, coder.path, tuple(calls))
    result = session_payload_bytes(coder)
    assert (result["incremental_calls"], result["full_calls"]) == (2, 2)


# --- the real recorded sessions: one per source ---


@pytest.fixture(scope="module")
def first_session_per_source() -> dict[str, Session]:
    root = default_traces_dir()
    if not root.is_dir():
        pytest.skip(f"no agent traces at {root} (set ONCE_SHARED_DATA)")
    return {source: load_sessions(root, source=source)[0] for source in SOURCES}


def incremental_calls(session):
    # (previous request, previous output, request) for every call the rule lets through.
    requests = session_requests(session)
    for positions in chains(session).values():
        for earlier, later in zip(positions, positions[1:], strict=False):
            previous, output = requests[earlier]
            request = requests[later][0]
            if full_request_reason(previous, output, request) is None:
                yield previous, output, request


@pytest.mark.parametrize("source", SOURCES)
def test_incremental_calls_keep_the_rules_invariant(first_session_per_source, source):
    session = first_session_per_source[source]
    num_checked = 0
    for previous, output, request in incremental_calls(session):
        new_items = incremental_request(previous, output, request, "resp_x")["input"]
        assert previous["input"] + output + new_items == request["input"]
        num_checked += 1
    assert num_checked == session_payload_bytes(session)["incremental_calls"] > 0


def test_mini_swe_agent_calls_after_the_first_are_all_incremental(first_session_per_source):
    result = session_payload_bytes(first_session_per_source[MINI_SWE_AGENT])
    assert result["full_calls"] == 1
    assert result["incremental_calls"] == result["calls"] - 1
    assert result["ratio"] > 10


def test_coder_is_incremental_within_each_role(first_session_per_source):
    session = first_session_per_source[CODER]
    result = session_payload_bytes(session)
    assert result["full_calls"] == len(chains(session)) > 1
    assert result["full_call_reasons"] == {FIRST_CALL: len(chains(session))}


def test_sweagent_1_0_output_elision_breaks_the_chain(first_session_per_source):
    result = session_payload_bytes(first_session_per_source[SWEAGENT_1_0])
    assert result["full_call_reasons"].get(HISTORY_EDITED, 0) > result["calls"] // 2


def test_sweagent_1_1_tool_calls_use_the_reconstructed_tools(first_session_per_source):
    session = first_session_per_source[SWEAGENT_1_1]
    tools = {tool["name"]: tool for tool in session_tools(session)}
    num_calls = 0
    for request, output in session_requests(session):
        assert request["tools"] == list(tools.values())
        for item in output:
            if item["type"] == "function_call":
                arguments = json.loads(item["arguments"])
                parameters = tools[item["name"]]["parameters"]
                assert set(parameters.get("required", [])) <= set(arguments)
                assert set(arguments) <= set(parameters.get("properties", {}))
                num_calls += 1
    assert num_calls > 0


def test_median_ratio_by_source_takes_the_median_per_source():
    short, long_ = make_session(["a"] * 2), make_session(["a"] * 20)
    medium = make_session(["a"] * 5)
    ratios = median_ratio_by_source([short, long_, medium, make_session(["b"], source=CODER)])
    assert ratios[MINI_SWE_AGENT] == session_payload_bytes(medium)["ratio"] > 1
    # One call: nothing to save, and the response.create envelope costs a few bytes.
    assert ratios[CODER] < 1
