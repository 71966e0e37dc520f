import json
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

from once.bench.traces import (
    CODER,
    MINI_SWE_AGENT,
    SOURCES,
    SWEAGENT_1_0,
    SWEAGENT_1_1,
    Call,
    Session,
    default_traces_dir,
    detect_format,
    load_session,
    load_sessions,
    serialize_messages,
    session_stats,
)
from once.protocol.errors import InvalidRequestError

CODER_ROLES = {"Manager", "Reproducer", "Debugger", "Programmer", "Tester"}
SESSIONS_PER_SOURCE = {MINI_SWE_AGENT: 34, CODER: 24, SWEAGENT_1_1: 4, SWEAGENT_1_0: 14}


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def extends(request: tuple[dict, ...], previous: Call) -> bool:
    expected = previous.messages + (previous.output,)
    return request[: len(expected)] == expected


# --- synthetic files: the rebuild rule of each format, pinned exactly ---


def test_mini_swe_agent_request_is_everything_before_each_reply(tmp_path):
    usage = {"prompt_tokens": 12, "completion_tokens": 3}
    path = write_json(
        tmp_path / "task.traj.json",
        {
            "trajectory_format": "mini-swe-agent-1",
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "task"},
                {"role": "assistant", "content": "ls", "extra": {"response": {"usage": usage}}},
                {"role": "user", "content": "a.py"},
                {"role": "assistant", "content": "done", "extra": {}},
            ],
        },
    )
    session = load_session(path)

    assert session.source == MINI_SWE_AGENT
    assert session.session_id == f"{tmp_path.name}/task"
    assert [call.output["content"] for call in session.calls] == ["ls", "done"]
    assert [len(call.messages) for call in session.calls] == [2, 4]
    assert session.calls[1].messages[2] == {"role": "assistant", "content": "ls"}
    assert session.calls[0].usage == usage
    assert session.calls[1].usage is None


def test_coder_request_is_the_speaking_roles_own_chat(tmp_path):
    def entry(agent, role, content):
        return {"agent": agent, "role": role, "content": content}

    path = write_json(
        tmp_path / "task.traj",
        {
            "trajectory": [{"action": "a"}],
            "history": [
                entry("Manager", "system", "m-sys"),
                entry("Manager", "user", "issue"),
                entry("Manager", "assistant", "plan"),
                entry("Programmer", "system", "p-sys"),
                entry("Programmer", "user", "fix it"),
                entry("Programmer", "assistant", "edit"),
                entry("Manager", "user", "programmer done"),
                entry("Manager", "assistant", "submit"),
            ],
        },
    )
    session = load_session(path)

    assert session.source == CODER
    assert [call.agent for call in session.calls] == ["Manager", "Programmer", "Manager"]
    assert [m["content"] for m in session.calls[1].messages] == ["p-sys", "fix it"]
    assert [m["content"] for m in session.calls[2].messages] == [
        "m-sys",
        "issue",
        "plan",
        "programmer done",
    ]


def test_sweagent_1_1_reply_is_taken_from_the_next_request(tmp_path):
    tool_call = {"id": "toolu_1", "type": "function", "function": {"name": "bash"}}
    system = {"role": "system", "content": "sys", "agent": "main"}
    task = {
        "role": "user",
        "content": [{"type": "text", "text": "ta"}, {"type": "text", "text": "sk"}],
    }
    reply = {"role": "assistant", "content": "look", "tool_calls": [tool_call], "thought": "t"}
    observation = {
        "role": "tool",
        "content": [{"type": "text", "text": "out", "cache_control": {"type": "ephemeral"}}],
        "tool_call_ids": ["toolu_1"],
        "cache_control": {"type": "ephemeral"},
    }
    final = {"role": "assistant", "content": "", "tool_calls": None}
    path = write_json(
        tmp_path / "task.traj",
        {
            "trajectory": [
                {"action": "ls", "response": "look", "query": [system, task]},
                {"action": "submit", "response": "", "query": [system, task, reply, observation]},
            ],
            "history": [system, task, reply, observation, final],
        },
    )
    session = load_session(path)

    assert session.source == SWEAGENT_1_1
    first, second = session.calls
    assert first.messages[1] == {"role": "user", "content": "task"}
    assert first.output == {"role": "assistant", "content": "look", "tool_calls": [tool_call]}
    # cache_control and SWE-agent's bookkeeping fields are not part of the request.
    assert second.messages[3] == {"role": "tool", "content": "out", "tool_call_id": "toolu_1"}
    assert second.output == {"role": "assistant", "content": ""}
    assert extends(second.messages, first)


def test_sweagent_1_0_snapshot_k_is_request_k_plus_1_and_exit_steps_are_not_calls(tmp_path):
    def message(role, content):
        return {"role": role, "content": content, "agent": "main"}

    head = [message("system", "sys"), message("user", "task")]
    after_0 = head + [message("assistant", "r0"), message("user", "obs0")]
    after_1 = after_0 + [message("assistant", "r1"), message("user", "obs1")]
    # The history processor elides old observations, so a later snapshot rewrites obs0.
    after_exit = (
        head
        + [message("assistant", "r0"), message("user", "(1 lines omitted)")]
        + after_1[4:]
        + [message("assistant", "Exit due to context window"), message("user", "")]
    )
    path = write_json(
        tmp_path / "task.traj",
        {
            "trajectory": [
                {"action": "ls", "response": "r0", "messages": after_0},
                {"action": "cat", "response": "r1", "messages": after_1},
                {"action": "", "response": "Exit due to context window", "messages": after_exit},
            ],
            "history": after_exit,
        },
    )
    session = load_session(path)

    assert session.source == SWEAGENT_1_0
    assert [call.output["content"] for call in session.calls] == ["r0", "r1"]
    assert [len(call.messages) for call in session.calls] == [2, 4]
    assert session.calls[1].messages[3]["content"] == "obs0"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "not a JSON"),
        ("{}", "unknown trajectory format"),
        ("[1, 2]", "unknown trajectory format"),
        ('{"trajectory": [], "history": []}', "unknown trajectory format"),
        ('{"trajectory_format": "mini-swe-agent-1", "messages": [{"content": "x"}]}', "malformed"),
        ('{"trajectory_format": "mini-swe-agent-1", "messages": []}', "no model calls"),
        (
            '{"trajectory": [{"query": [{"role": "user", "content": "x"}]}], "history": []}',
            "malformed",
        ),
    ],
)
def test_bad_files_raise_invalid_request_naming_the_file(tmp_path, text, reason):
    path = tmp_path / "bad.traj"
    path.write_text(text)
    with pytest.raises(InvalidRequestError, match=reason) as raised:
        load_session(path)
    assert str(path) in raised.value.message


def test_undecodable_bytes_raise_invalid_request(tmp_path):
    path = tmp_path / "bad.traj"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InvalidRequestError, match="not a JSON"):
        detect_format(path)


def test_load_sessions_rejects_an_unknown_source(tmp_path):
    with pytest.raises(ValueError, match="unknown source"):
        load_sessions(tmp_path, source="nope")


# --- the real recorded sessions in ../shared/data/agent_traces ---


@pytest.fixture(scope="module")
def sessions_by_source() -> dict[str, list[Session]]:
    root = default_traces_dir()
    if not root.is_dir():
        pytest.skip(f"no agent traces at {root} (set ONCE_SHARED_DATA)")
    by_source = defaultdict(list)
    for session in load_sessions(root):
        by_source[session.source].append(session)
    return by_source


def test_every_session_of_every_source_loads(sessions_by_source):
    assert {s: len(v) for s, v in sessions_by_source.items()} == SESSIONS_PER_SOURCE
    assert set(sessions_by_source) == set(SOURCES)


def test_number_of_calls_matches_the_recorded_api_calls(sessions_by_source):
    for sessions in sessions_by_source.values():
        for session in sessions:
            recorded = json.loads(session.path.read_bytes())["info"]["model_stats"]["api_calls"]
            assert len(session.calls) == recorded, session.session_id


def test_messages_are_openai_chat_style(sessions_by_source):
    allowed_keys = {
        "system": {"role", "content"},
        "user": {"role", "content"},
        "assistant": {"role", "content", "tool_calls"},
        "tool": {"role", "content", "tool_call_id"},
    }
    for sessions in sessions_by_source.values():
        for session in sessions:
            for call in session.calls:
                assert call.messages and call.messages[0]["role"] == "system"
                assert call.output["role"] == "assistant"
                for message in call.messages + (call.output,):
                    assert set(message) <= allowed_keys[message["role"]]
                    assert {"role", "content"} <= set(message)
                    assert isinstance(message["content"], str)


def test_mini_swe_agent_is_append_only_and_keeps_usage(sessions_by_source):
    for session in sessions_by_source[MINI_SWE_AGENT]:
        for previous, call in pairwise(session.calls):
            assert extends(call.messages, previous), (session.session_id, call.index)
        assert all(call.usage["prompt_tokens"] > 0 for call in session.calls)


def test_coder_is_append_only_within_each_role(sessions_by_source):
    agents = Counter()
    for session in sessions_by_source[CODER]:
        last_call_of = {}
        for call in session.calls:
            agents[call.agent] += 1
            if call.agent in last_call_of:
                assert extends(call.messages, last_call_of[call.agent])
            last_call_of[call.agent] = call
    assert set(agents) == CODER_ROLES


def test_claude_is_append_only_except_after_a_format_error(sessions_by_source):
    # A reply without a tool call is answered with an error and re-queried; once a valid
    # reply arrives, the failed reply and the error leave the history again.
    num_breaks = 0
    for session in sessions_by_source[SWEAGENT_1_1]:
        for previous, call in pairwise(session.calls):
            if not extends(call.messages, previous):
                num_breaks += 1
                assert len(call.messages) == len(previous.messages)
                assert previous.messages[-1]["content"].startswith("Your last output did not")
    assert num_breaks == 3


def test_sweagent_outputs_are_the_recorded_responses(sessions_by_source):
    for sessions in (sessions_by_source[SWEAGENT_1_1], sessions_by_source[SWEAGENT_1_0]):
        for session in sessions:
            steps = json.loads(session.path.read_bytes())["trajectory"]
            responses = [s["response"] for s in steps if not s["response"].startswith("Exit due")]
            assert [call.output["content"] for call in session.calls] == responses


def test_claude_tool_results_answer_the_preceding_tool_call(sessions_by_source):
    for session in sessions_by_source[SWEAGENT_1_1]:
        messages = session.calls[-1].messages
        for reply, result in pairwise(messages):
            if result["role"] == "tool":
                assert result["tool_call_id"] == reply["tool_calls"][0]["id"]


def test_stats_count_the_previous_request_as_shared_prefix(sessions_by_source):
    session = sessions_by_source[MINI_SWE_AGENT][0]
    stats = session_stats(session)
    assert stats[0].shared_chars == 0
    for previous, call_stats in zip(session.calls[:-1], stats[1:], strict=True):
        # Append-only: all of the previous request but its closing "]" is repeated.
        assert call_stats.shared_chars == len(serialize_messages(previous.messages)) - 1
        assert call_stats.new_chars == call_stats.request_chars - call_stats.shared_chars


def test_repeated_share_per_source_matches_the_data_readme(sessions_by_source):
    # README (agent_traces): 96.7% Gemini, 85.1% GPT-4, 93.5% Claude, 59.0% LM-32B.
    expected = {MINI_SWE_AGENT: 0.967, CODER: 0.851, SWEAGENT_1_1: 0.935, SWEAGENT_1_0: 0.59}
    for source, sessions in sessions_by_source.items():
        stats = [s for session in sessions for s in session_stats(session)]
        share = sum(s.shared_chars for s in stats) / sum(s.request_chars for s in stats)
        assert share == pytest.approx(expected[source], abs=0.03), source
